"""The engine process's event stream (services.worker.engine_process): length-prefixed pickles
over a Unix stream, cut back into messages whatever the chunks the kernel hands over."""

from __future__ import annotations

import asyncio
import pickle
import random

import pytest

from services.worker.engine_process import FRAME, _EventStream


def frames(messages: list[tuple[object, ...]]) -> bytes:
    out = b""
    for message in messages:
        payload = pickle.dumps(message)
        out += FRAME.pack(len(payload)) + payload
    return out


@pytest.mark.parametrize("seed", range(5))
async def test_messages_come_out_whole_and_in_order_from_any_chunking(seed: int) -> None:
    rng = random.Random(seed)
    messages = [("out", i, "x" * rng.randrange(0, 5000)) for i in range(200)]
    data = frames(messages)
    got: list[tuple[object, ...]] = []
    ended: list[bool] = []
    stream = _EventStream(got.append, lambda: ended.append(True), asyncio.get_running_loop().create_future())
    pos = 0
    while pos < len(data):  # chunks of 1 byte up to several messages
        step = rng.choice([1, 3, FRAME.size, 100, 4096, 20000])
        stream.data_received(data[pos : pos + step])
        pos += step
    assert got == messages and not ended
    stream.connection_lost(None)
    assert ended == [True]


async def test_a_failing_dispatch_is_reported_to_the_supervised_future() -> None:
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def dispatch(message: tuple[object, ...]) -> None:
        raise RuntimeError(f"bug handling {message[0]}")

    stream = _EventStream(dispatch, lambda: None, failed)
    with pytest.raises(RuntimeError, match="bug handling out"):
        stream.data_received(frames([("out", 1)]))
    with pytest.raises(RuntimeError, match="bug handling out"):
        failed.result()
