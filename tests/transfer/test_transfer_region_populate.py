"""Region.populate: every page of the region is allocated up front (the store node's segment), so
no write on the data path pays a page fault; the bytes stay what they were."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from yutu.transfer.errors import RegionError
from yutu.transfer.region import Region


def test_populate_allocates_every_page_of_the_file_and_keeps_the_bytes(tmp_path: Path) -> None:
    size = 4 << 20
    region = Region.create("seg", size, shm_dir=str(tmp_path))
    try:
        region.buffer[:5] = b"hello"  # one page touched
        assert os.stat(region.path).st_blocks * 512 <= 64 << 10  # the rest is not allocated yet
        assert region.populate() is True
        assert os.stat(region.path).st_blocks * 512 >= size  # every page is there now
        assert bytes(region.buffer[:5]) == b"hello" and not region.view_numpy()[5:].any()
    finally:
        region.close()
    with pytest.raises(RegionError, match="closed"):
        region.populate()
