"""A store node: contributes a DRAM segment (and optionally a disk tier) to the distributed KV pool."""
