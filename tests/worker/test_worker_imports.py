"""KV imports refuse a prefill's blocks laid out unlike their own, and a request told before its
prefill ended waits for it, or frees its blocks when aborted (control logic, fakes for I/O)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from yutu.engine.scheduler import KVLoad
from yutu.protocol.prefill import KVHandle

from services.worker.imports import Awaiting, FromPeer, KVImports

BLOCK_SIZE = 16


class FakeFront:
    def __init__(self) -> None:
        self.finished: list[tuple[str, int, int | None]] = []

    def finish_load(self, request_id: str, num_tokens: int, token: int | None = None) -> None:
        self.finished.append((request_id, num_tokens, token))


class NoTransfer:
    async def transfer(self, requests: Any) -> Any:
        raise AssertionError("a mismatched handle must not be pulled")


def handle(block_bytes: int, kv_salt: str) -> KVHandle:
    # held under the prefill's id, which need not be the decode's (a re-placed prefill: r1-p1 there)
    return KVHandle(
        "prefill-0", "r1-held", "tcp://p:1", "seg-p", "kv-p", [7, 8, 9], 40, block_bytes, 5.0, kv_salt
    )


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
        lambda h: released.append((h.instance_id, h.hold_id)), kv_salt=ours[1],
    )  # fmt: skip
    imports.expect("r1", FromPeer(handle(*theirs)))
    with caplog.at_level(logging.ERROR, logger="services.worker.imports"):
        await imports._load(
            KVLoad("r1", first_block=0, block_ids=[1, 2, 3], num_cached_tokens=0, num_tokens=40)
        )
    assert front.finished == [("r1", 0, None)]  # nothing imported: the engine computes all 40 tokens
    assert released == [("prefill-0", "r1-held")]  # the prefill's hold is let go at once
    assert imports.mismatched == 1 and imports.failed == 1
    assert needle in caplog.text and "start them alike" in caplog.text


def awaiting_imports(released: list[tuple[str, str]]) -> tuple[FakeFront, KVImports]:
    """Imports whose peer's handles never match (so a started pull ends at once, transferring nothing)."""
    front = FakeFront()
    imports = KVImports(
        front, NoTransfer(), SimpleNamespace(name="kv-d", block_bytes=32768), None, None, BLOCK_SIZE,  # type: ignore[arg-type]
        lambda h: released.append((h.instance_id, h.hold_id)), kv_salt="tiny",
    )  # fmt: skip
    return front, imports


LOAD = KVLoad("r1", first_block=0, block_ids=[1, 2, 3], num_cached_tokens=0, num_tokens=40)


@pytest.mark.parametrize("order", ["admitted-first", "ready-first"])
async def test_an_awaiting_load_starts_when_both_the_engine_and_the_prefill_are_done(order: str) -> None:
    released: list[tuple[str, str]] = []
    front, imports = awaiting_imports(released)
    imports.expect("r1", Awaiting(40))
    steps = [lambda: imports.on_loads([LOAD]), lambda: imports.ready("r1", handle(16384, "tiny"), 77)]
    first, second = steps if order == "admitted-first" else steps[::-1]
    first()
    await asyncio.sleep(0)
    assert front.finished == [] and imports.awaited_tokens("r1") == (
        40 if order == "admitted-first" else None
    )
    second()
    await asyncio.gather(*imports._tasks)
    assert front.finished == [("r1", 0, 77)]  # the first token goes with the load's answer
    assert released == [("prefill-0", "r1-held")]


async def test_an_awaiting_request_aborted_after_its_admission_frees_its_blocks_at_once() -> None:
    released: list[tuple[str, str]] = []
    front, imports = awaiting_imports(released)
    imports.expect("r1", Awaiting(40))
    imports.on_loads([LOAD])
    imports.drop("r1")
    assert front.finished == [("r1", 0, None)] and not imports._tasks  # no copy, no token: freed
    assert imports.awaited_tokens("r1") is None and released == []  # no hold was ever named


async def test_a_load_that_comes_after_its_request_was_dropped_is_answered_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    released: list[tuple[str, str]] = []
    front, imports = awaiting_imports(released)
    imports.expect("r1", FromPeer(handle(32768, "tiny")))
    imports.drop("r1")  # aborted while the engine was admitting it
    assert released == [("prefill-0", "r1-held")]  # the hold goes at once, unread
    with caplog.at_level(logging.INFO, logger="services.worker.imports"):
        imports.on_loads([LOAD])
        await asyncio.gather(*imports._tasks)
    assert front.finished == [("r1", 0, None)] and caplog.text == ""
