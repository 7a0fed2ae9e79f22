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


def handle(block_bytes: int) -> KVHandle:
    return KVHandle("prefill-0", "tcp://p:1", "seg-p", "kv-p", [7, 8, 9], 40, block_bytes, 5.0)


async def test_a_handle_of_another_block_layout_is_released_and_the_prompt_computed_here(
    caplog: pytest.LogCaptureFixture,
) -> None:
    front, released = FakeFront(), []
    imports = KVImports(
        front, NoTransfer(), SimpleNamespace(name="kv-d", block_bytes=32768), None, None, BLOCK_SIZE,  # type: ignore[arg-type]
        lambda h, seq_id: released.append((h.instance_id, seq_id)),
    )  # fmt: skip
    imports.expect("r1", FromPeer(handle(block_bytes=16384)))  # a bfloat16 prefill, a float32 decode
    with caplog.at_level(logging.ERROR, logger="services.worker.imports"):
        await imports._load(
            KVLoad("r1", first_block=0, block_ids=[1, 2, 3], num_cached_tokens=0, num_tokens=40)
        )
    assert front.finished == [("r1", 0)]  # nothing imported: the engine computes all 40 tokens
    assert released == [("prefill-0", "r1")]  # the prefill's hold is let go at once
    assert imports.mismatched == 1 and imports.failed == 1
    assert "holds KV blocks of 16384 bytes, this instance's are 32768" in caplog.text
    assert "--dtype" in caplog.text
