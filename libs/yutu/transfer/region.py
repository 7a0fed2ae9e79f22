"""Registered memory regions: host memory backed by a shared-memory file.

A ``Region`` is a named, fixed-size byte range that the transfer engine may read from and write to
on behalf of peers. Its memory is a file under ``/dev/shm`` (tmpfs), mapped ``MAP_SHARED``, so a
peer process on the same host can map the very same pages by path and copy with one memcpy; peers
on other hosts go through the engine's TCP data server, which reads and writes the same mapping.

Lifetime: the owner creates the file (``Region.create``) and unlinks it on ``close()``. A process
killed with SIGKILL leaves its files behind; ``sweep_stale_region_files()`` removes the files of
dead processes on this host.

The rule that decides a file is stale (and that can never remove a live owner's file): the owner
holds a shared ``flock`` on the file from before it gets its name until it is unlinked; the kernel
drops that lock when the owner dies, however it dies. A file is stale when **both**

- the pid in its name (``yutu-region-<pid>-<token>-<size>``) is not a live process here, and
- no process holds its lock (the sweeper's exclusive non-blocking ``flock`` succeeds).

The lock makes pid namespaces harmless (a live owner in another container sharing ``/dev/shm``
still holds it) and pid reuse cannot remove anything (a reused pid only keeps a dead owner's file
until the next sweep). The pid test keeps files of writers that take no lock (older versions).
The file is created under a hidden temporary name, locked, then renamed, so no file ever carries a
region name without its lock; a temporary file left by an owner that died in between is removed
once it is older than ``TMP_GRACE_S``.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import tempfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from yutu.transfer.errors import OutOfRangeError, RegionError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FILE_PREFIX = "yutu-region"
MAX_REGION_NAME_BYTES = 255
TMP_GRACE_S = 60.0  # a temporary file older than this lost its creator between create and rename
_FILE_RE = re.compile(rf"^{FILE_PREFIX}-(\d+)-[0-9a-f]+-(\d+)$")
_TMP_RE = re.compile(rf"^\.{FILE_PREFIX}-(\d+)-[0-9a-f]+-(\d+)\.tmp$")


SHM_DIR_ENV = "YUTU_SHM_DIR"


def shm_directory() -> str:
    """The directory region files live in (and the one sweeps clean): ``$YUTU_SHM_DIR`` when set
    (another tmpfs; tests give their processes a directory no other sweep touches), else
    ``/dev/shm`` where it exists, else the temp dir."""
    chosen = os.environ.get(SHM_DIR_ENV)
    if chosen:
        return chosen
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def validate_region_name(name: str) -> bytes:
    """Return ``name`` encoded as UTF-8, or raise ``RegionError`` if it cannot be a region name."""
    if not isinstance(name, str) or not name:
        raise RegionError(f"region name must be a non-empty str, got {name!r}")
    encoded = name.encode("utf-8")
    if len(encoded) > MAX_REGION_NAME_BYTES:
        raise RegionError(f"region name {name!r} is longer than {MAX_REGION_NAME_BYTES} bytes; shorten it")
    return encoded


def check_range(region_name: str, region_size: int, offset: int, length: int) -> None:
    """Raise ``OutOfRangeError`` unless ``[offset, offset + length)`` lies inside ``[0, region_size)``.

    ``length`` must be positive: an empty transfer is a caller bug, not a no-op.
    """
    if length <= 0:
        raise OutOfRangeError(f"length must be positive, got {length} (region {region_name!r})")
    if offset < 0 or offset + length > region_size:
        raise OutOfRangeError(
            f"range [{offset}, {offset + length}) is outside region {region_name!r} of {region_size} bytes"
        )


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11 lacks the name


class Region:
    """A named byte range of shared memory owned by this process.

    ``buffer`` is a writable ``memoryview`` of the whole region; ``view_numpy()`` and ``view_torch()``
    are zero-copy views over the same pages. Views stay valid after ``close()`` (the pages are freed
    when the last view is gone) but no longer reach peers.
    """

    def __init__(self, name: str, size: int, path: str, fd: int, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self.path = path
        st = os.fstat(fd)
        self.inode = st.st_ino  # lets a peer check it mapped this very file, not a namesake
        self._fd: int | None = fd
        self._mmap: mmap.mmap | None = mm
        self._buffer = memoryview(mm)
        self._array = np.frombuffer(mm, dtype=np.uint8)  # (size,)

    @classmethod
    def create(cls, name: str, size: int, shm_dir: str | None = None) -> Region:
        """Create a zero-filled region of ``size`` bytes backed by a new file in ``shm_dir``
        (default ``shm_directory()``)."""
        validate_region_name(name)
        if not isinstance(size, int) or size <= 0:
            raise RegionError(f"region size must be a positive int, got {size!r} (region {name!r})")
        directory = shm_dir or shm_directory()
        base = f"{FILE_PREFIX}-{os.getpid()}-{secrets.token_hex(6)}-{size}"
        path, tmp = os.path.join(directory, base), os.path.join(directory, f".{base}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        named = tmp
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held until close(): we are alive (see the module doc)
            os.ftruncate(fd, size)
            os.rename(tmp, path)
            named = path
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(named)
            raise
        return cls(name, size, path, fd, mm)

    def populate(self) -> bool:
        """Fault every page in now (``MADV_POPULATE_WRITE``), so the first write into each page is
        not a page fault on the data path -- ~5 us a page in a VM here: 80 us of a 64 KiB put into
        fresh space, 2.6 ms of a 2 MiB batch. Commits the region's memory (like registering it for
        RDMA would). False when the kernel refuses (before 5.14, or the shared-memory filesystem is
        full): the pages then fault in on first use, as without it. Blocks: call it off the loop."""
        if self._mmap is None:
            raise RegionError(f"region {self.name!r} is closed")
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            return False
        return True

    def fault_in(self, what: str) -> bool:
        """:meth:`populate`, logged as ``what`` (e.g. "KV cache"): how long it took, or why the
        pages fault in on first use instead. Blocks: call it off the loop."""
        started = time.monotonic()
        if self.populate():
            log.info("faulted in the %d-byte %s in %.2f s", self.size, what, time.monotonic() - started)
            return True
        log.warning("could not fault the %s in (kernel before 5.14, or %s full): pages fault in on first use",
                    what, os.path.dirname(self.path))  # fmt: skip
        return False

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def buffer(self) -> memoryview:
        """Writable memoryview of the whole region (format ``B``, ``size`` bytes)."""
        self._check_open()
        return self._buffer

    def _check_open(self) -> None:
        if self._mmap is None:
            raise RegionError(f"region {self.name!r} is closed (unregistered); register it again")

    def view_numpy(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        """A writable ``uint8`` array over ``[offset, offset + length)`` (default: to the end)."""
        self._check_open()
        length = self.size - offset if length is None else length
        check_range(self.name, self.size, offset, length)
        return self._array[offset : offset + length]

    def view_torch(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` over the region bytes starting at ``offset``.

        ``offset`` must be a multiple of the dtype's item size; the tensor shares memory with the
        region (writes through it are visible to peers).
        """
        import torch  # local: keep torch off the import path of processes that only move bytes

        self._check_open()
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for dim in shape:
            count *= dim
        if offset % itemsize:
            raise RegionError(f"offset {offset} is not a multiple of {dtype} item size {itemsize}")
        check_range(self.name, self.size, offset, count * itemsize)
        flat = torch.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)  # (count,)
        return flat.view(shape)

    def close(self) -> None:
        """Unlink the backing file and drop this object's mapping. Idempotent."""
        if self._mmap is None:
            return
        mm, fd = self._mmap, self._fd
        self._mmap = None
        self._fd = None
        try:
            self._buffer.release()
        except BufferError:
            pass  # a torch view was built from it; the memoryview dies with that view
        self._array = np.empty(0, dtype=np.uint8)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if fd is not None:
            os.close(fd)
        try:
            mm.close()
        except BufferError:
            pass  # user views still export the pages: they are unmapped when the last view dies

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.path
        return f"Region({self.name!r}, size={self.size}, {state})"

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sweep_stale_region_files(shm_dir: str | None = None) -> list[str]:
    """Remove the region files whose owner is gone (the rule is in the module doc); return their paths.

    Safe to run at any time from any process: a live owner's file is never removed.
    """
    directory = shm_dir or shm_directory()
    removed: list[str] = []
    for entry in os.listdir(directory):
        match = _FILE_RE.match(entry) or _TMP_RE.match(entry)
        if match is None or pid_alive(int(match.group(1))):
            continue
        path = os.path.join(directory, entry)
        if _remove_if_unlocked(path, min_age_s=TMP_GRACE_S if entry.startswith(".") else 0.0):
            removed.append(path)
    return removed


def _remove_if_unlocked(path: str, min_age_s: float) -> bool:
    """Unlink ``path`` if no process holds its lock (and it is at least ``min_age_s`` old)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone meanwhile, another user's, a symlink: not ours to judge
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner is alive (in a pid namespace we cannot see)
        st = os.fstat(fd)
        if time.time() - st.st_mtime < min_age_s or os.stat(path).st_ino != st.st_ino:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def reclaim_stale_regions(shm_dir: str | None = None) -> tuple[int, int]:
    """Sweep (see :func:`sweep_stale_region_files`) and log what was reclaimed: ``(files, bytes)``.

    Called where regions are about to be created (``yutu up``, a store node's start-up), and by
    ``yutu up`` once its children have stopped.
    """
    removed = sweep_stale_region_files(shm_dir)
    names = [os.path.basename(p) for p in removed]
    nbytes = sum(int(m.group(2)) for n in names if (m := _FILE_RE.match(n) or _TMP_RE.match(n)))
    if removed:
        log.info(
            "reclaimed %d shared-memory region file(s) of dead processes (%d MiB): %s",
            len(removed),
            nbytes >> 20,
            ", ".join(names),
        )
    return len(removed), nbytes


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists in our pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
