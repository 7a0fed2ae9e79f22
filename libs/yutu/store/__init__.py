"""The distributed KV store: client, replica descriptors and the allocator shared with the master."""
