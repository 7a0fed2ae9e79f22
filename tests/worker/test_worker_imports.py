"""KV imports refuse a prefill's blocks laid out unlike their own (control logic, fakes for I/O)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from yutu.engine.scheduler import KVLoad
from yutu.protocol.prefill import KVHandle

from services.worker.imports import FromPeer, KVImports

BLOCK_SIZE = 16


class FakeFront:
    def __init__(self) -> None:
        self.finished: list[tuple[str, int]] = []

    def finish_load(self, request_id: str, num_tokens: int) -> None:
        self.finished.append((request_id, num_tokens))


class NoTransfer:
    async def transfer(self, requests: Any) -> Any:
        raise AssertionError("a mismatched handle must not be pulled")


def handle(block_bytes: int, kv_salt: str) -> KVHandle:
    return KVHandle("prefill-0", "tcp://p:1", "seg-p", "kv-p", [7, 8, 9], 40, block_bytes, 5.0, kv_salt)


@pytest.mark.parametrize(
    ("theirs", "ours", "needle"),
    [
        ((16384, "tiny@bfloat16"), (32768, "tiny"), "holds KV blocks of 16384 bytes, this instance's are 32768"),
        ((16384, "tiny@bfloat16"), (16384, "tiny@float16"), "computed its KV as 'tiny@bfloat16', this instance as 'tiny@float16'"),
        ((32768, "other-model"), (32768, "tiny"), "computed its KV as 'other-model', this instance as 'tiny'"),
    ],
    ids=["bf16-prefill-fp32-decode", "bf16-prefill-fp16-decode", "another-model"],
)  # fmt: skip
async def test_a_handle_of_another_kv_layout_is_released_and_the_prompt_computed_here(
    theirs: tuple[int, str], ours: tuple[int, str], needle: str, caplog: pytest.LogCaptureFixture
) -> None:
    front, released = FakeFront(), []
    imports = KVImports(
        front, NoTransfer(), SimpleNamespace(name="kv-d", block_bytes=ours[0]), None, None, BLOCK_SIZE,  # type: ignore[arg-type]
        lambda h, seq_id: released.append((h.instance_id, seq_id)), kv_salt=ours[1],
    )  # fmt: skip
    imports.expect("r1", FromPeer(handle(*theirs)))
    with caplog.at_level(logging.ERROR, logger="services.worker.imports"):
        await imports._load(
            KVLoad("r1", first_block=0, block_ids=[1, 2, 3], num_cached_tokens=0, num_tokens=40)
        )
    assert front.finished == [("r1", 0)]  # nothing imported: the engine computes all 40 tokens
    assert released == [("prefill-0", "r1")]  # the prefill's hold is let go at once
    assert imports.mismatched == 1 and imports.failed == 1
    assert needle in caplog.text and "start them alike" in caplog.text
