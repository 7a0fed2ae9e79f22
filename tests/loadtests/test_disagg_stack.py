"""The benches' stack harness (loadtests/disagg_stack.py) against a real ``yutu up``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "loadtests"))

from disagg_stack import BANNER_END, Stack, StackSpec, private_dir, shm_directory  # noqa: E402


def test_a_stack_started_again_in_its_work_dir_waits_for_its_own_banner(tmp_path: Path) -> None:
    # yutu up's log is appended to, so the first start's banner is already in it when the second
    # starts: the harness must wait for the second's, not serve requests to a gateway not yet up.
    spec = StackSpec("again", workers=1, store_nodes=0, max_model_len=512, kv_cache_memory_mib=32)
    with private_dir(tmp_path, "yutu-again-") as work, shm_directory() as shm:
        for _ in range(2):
            with Stack(spec, work / "s", shm) as stack:
                assert stack.http.get("/v1/models").status_code == 200
                assert stack.model and stack.vocab_size > 0
        assert (work / "s" / "logs" / "yutu-up.log").read_text().count(BANNER_END) == 2
