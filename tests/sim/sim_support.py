"""A tiny profile whose every time is exact in binary floating point, and trace builders.

The profile: blocks of 4 tokens, 16 bytes of KV per token (64 B per block) over 1024 B/s with no
latency (a block moves in 2**-4 s, a prompt of L tokens hands over in L/64 s); prefill 2**-3 s per
computed token and nothing else; a decode step 2**-4 s whatever the batch.
"""

from __future__ import annotations

import json
from pathlib import Path

from yutu.sim.profile import Profile
from yutu.sim.trace import TraceRequest, make_request

BS = 4
PER_TOKEN = 2.0**-3
STEP = 2.0**-4


def tiny_profile(**changes: object) -> Profile:
    fields: dict[str, object] = dict(
        name="tiny", block_size=BS, kv_bytes_per_token=16, prefill=(0.0, PER_TOKEN, 0.0),
        decode=(STEP, 0.0, 0.0), network_bps=1024.0, transfer_latency_s=0.0, prefill_kv_blocks=1000,
        cache_blocks=100, decode_kv_blocks=1000, max_batch=8, source="test",
    )  # fmt: skip
    fields.update(changes)
    return Profile(**fields)  # type: ignore[arg-type]


def req(index: int, arrival_s: float, length: int, output: int, ids: list[int]) -> TraceRequest:
    return make_request(index, arrival_s, length, output, tuple(ids), BS)


def write_trace(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    """(timestamp ms, input_length, output_length, hash_ids) per line."""
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) + "\n"
            for t, n, o, h in rows
        )
    )
    return path
