"""Mooncake-format traces: one JSON object per line (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``: one chained id per block of the prompt, the last one possibly partial).

Block keys are the ids in the conductor's key format (32 hex digits, as ``yutu.kv.hashing`` keys and
the conductor's KV-event decoding write them); a request's *full* blocks (``input_length // block_size``
of them) are the ones a cache can hold and reuse, as in the engine (a partial tail block has no key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A trace line that is not a valid request (the message names the file and line)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace; ``arrival_s`` is already divided by the time scale."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_keys: tuple[str, ...]  # keys of the full blocks, in order

    @property
    def request_id(self) -> str:
        return f"r{self.index}"


def block_key(hash_id: int) -> str:
    """The key of a trace block: what the conductor makes of a KV event carrying ``hash_id``."""
    return format(hash_id, "032x")


def make_request(
    index: int,
    arrival_s: float,
    input_length: int,
    output_length: int,
    hash_ids: tuple[int, ...],
    block_size: int,
) -> TraceRequest:
    """A request with its full-block keys derived from ``hash_ids``."""
    full = min(len(hash_ids), input_length // block_size)
    return TraceRequest(
        index, arrival_s, input_length, output_length, hash_ids, tuple(block_key(h) for h in hash_ids[:full])
    )


def _int(row: dict[str, object], name: str, minimum: int, where: str) -> int:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_line(line: str, index: int, time_scale: float, block_size: int, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object")
    ts = row.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number of milliseconds >= 0, got {ts!r}")
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    return make_request(
        index,
        ts / 1000.0 / time_scale,
        _int(row, "input_length", 1, where),
        _int(row, "output_length", 1, where),
        tuple(ids),
        block_size,
    )


def load_trace(
    path: str | Path, *, time_scale: float = 1.0, block_size: int = 512, limit: int | None = None
) -> list[TraceRequest]:
    """The requests of ``path`` in arrival order (stable for equal timestamps).

    ``time_scale`` k replays the trace k times faster (arrivals divided by k); ``limit`` keeps the
    first requests only. Raises :class:`TraceError` for a malformed line, ValueError for bad options.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0 (2 replays twice as fast), got {time_scale!r}")
    path = Path(path)
    out: list[TraceRequest] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            out.append(parse_line(line, len(out), time_scale, block_size, f"{path}:{number}"))
    if not out:
        raise TraceError(f"{path}: no requests")
    out.sort(key=lambda r: (r.arrival_s, r.index))
    return out
