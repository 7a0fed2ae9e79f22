"""The store master: metadata of the distributed KV pool (segments, objects, replicas, leases, eviction)."""
