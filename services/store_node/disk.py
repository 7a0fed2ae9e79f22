"""A store node's disk tier: one file per evicted object in a directory of its own.

The master decides what moves (see ``services.store_master.disk_tier``); this class copies bytes
between the node's DRAM region and files. Methods block (file I/O): call them in a thread.
File names are the SHA-256 of the object key, so any key is a safe file name.
"""

from __future__ import annotations

import hashlib
import os

from yutu.transfer import Region

SUFFIX = ".obj"


class DiskTierFiles:
    def __init__(self, directory: str, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity}")
        self.directory = directory
        self.capacity = capacity
        os.makedirs(directory, exist_ok=True)

    def path(self, key: str) -> str:
        return os.path.join(
            self.directory, hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest() + SUFFIX
        )

    def clear(self) -> int:
        """Delete every object file (a new node incarnation starts with an empty tier)."""
        removed = 0
        for name in os.listdir(self.directory):
            if name.endswith(SUFFIX) or name.endswith(SUFFIX + ".tmp"):
                os.unlink(os.path.join(self.directory, name))
                removed += 1
        return removed

    def offload(self, region: Region, key: str, offset: int, length: int) -> None:
        """Copy ``region[offset : offset + length]`` into the key's file (atomically replaced)."""
        if offset < 0 or length <= 0 or offset + length > region.size:
            raise ValueError(f"range [{offset}, {offset + length}) is outside region {region.name!r}")
        path = self.path(key)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(region.buffer[offset : offset + length])
        os.replace(tmp, path)

    def promote(self, region: Region, key: str, offset: int, length: int) -> None:
        """Copy the key's file into ``region[offset : offset + length]``, then delete the file."""
        if offset < 0 or length <= 0 or offset + length > region.size:
            raise ValueError(f"range [{offset}, {offset + length}) is outside region {region.name!r}")
        path = self.path(key)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != length:
                raise ValueError(f"disk copy of {key!r} has {size} bytes, expected {length}")
            view = region.buffer[offset : offset + length]
            done = 0
            while done < length:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError(f"disk copy of {key!r} ended early at {done} bytes")
                done += n
        os.unlink(path)

    def drop(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    def used_bytes(self) -> int:
        return sum(
            os.path.getsize(os.path.join(self.directory, n))
            for n in os.listdir(self.directory)
            if n.endswith(SUFFIX)
        )
