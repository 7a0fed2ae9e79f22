"""A node with a disk tier: evicted objects move to disk and come back on read, byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

from tests.store.conftest import Cluster

SLOT = 64 << 10


async def test_evicted_objects_go_to_disk_and_come_back(store_cluster: Cluster, tmp_path: Path) -> None:
    master = store_cluster.master()
    disk = tmp_path / "disk"
    node = store_cluster.node("n0", size="1MiB", disk_dir=str(disk), disk_capacity="4MiB")
    client = await store_cluster.client(reserve_bytes=0)  # exact space: no reservations held
    blobs = {f"d{i:02d}": os.urandom(SLOT - 7 * i) for i in range(24)}  # 1.5x the DRAM segment
    for key, data in blobs.items():
        assert await client.put(key, data) is True
    store_cluster.wait_for(lambda: master.get("/stats").json()["offloaded_objects"] >= 8, 10, "offloads")
    stats = master.get("/stats").json()
    assert stats["used"] <= 0.9 * (1 << 20) and stats["disk_used"] > 0
    assert stats["objects"] == 24  # nothing lost: on disk or in DRAM
    assert len(list(disk.glob("*.obj"))) == stats["offloaded_objects"] - stats["promoted_objects"]
    keys = list(blobs)
    for i in range(0, len(keys), 4):  # reads bring disk objects back (evicting others to disk)
        assert await client.get_batch(keys[i : i + 4]) == [blobs[k] for k in keys[i : i + 4]]
    stats = master.get("/stats").json()
    assert stats["promoted_objects"] >= 8 and stats["objects"] == 24

    def node_and_master_agree() -> bool:  # an offload may still be in flight right after the reads
        tasks = node.get("/stats").json()["disk_tasks"]
        stats = master.get("/stats").json()
        return (tasks["offload"], tasks["promote"]) == (stats["offloaded_objects"], stats["promoted_objects"])

    store_cluster.wait_for(node_and_master_agree, 5, "the disk-tier tasks to settle")
    assert node.get("/stats").json()["disk_tasks"]["failed"] == 0
    # removing an object that sits on disk deletes its file
    on_disk = [k for k in keys if master.get(f"/objects/{k}").json()["replicas"][0][6] == "disk"]
    assert on_disk
    files = len(list(disk.glob("*.obj")))
    assert await client.remove(on_disk[0]) is True
    store_cluster.wait_for(lambda: len(list(disk.glob("*.obj"))) == files - 1, 5, "the file to be dropped")
