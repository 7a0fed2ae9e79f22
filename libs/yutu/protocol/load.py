"""The load channel: every prefill and decode instance tells the conductor how busy it is.

ZeroMQ PUB (the instance) -> SUB (the conductor), one :class:`LoadReport` every report interval
and right after a change of its queue. The conductor keeps the last report of each instance and
feeds the measurements into its cost models; a lost report is simply superseded by the next.

    instance                     conductor
    LoadReport   ------------->  view[instance] = report; models.observe(report.prefills, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yutu.protocol.codec import Channel

CHANNEL = Channel("load", version=3)  # 3: a queued row carries its priority and admitted


@CHANNEL.message("load")
@dataclass
class LoadReport:
    instance_id: str
    role: str  # "prefill" | "decode" | "mixed"
    seq: int  # increases by one per report of this incarnation
    time: float  # wall clock when the report was made
    num_running: int
    num_waiting: int
    num_held: int  # requests whose blocks wait for their decode (prefill role)
    free_blocks: int
    total_blocks: int
    block_size: int
    # Prefill work not done yet, one [prompt_len, reused_prefix_len, computed_tokens, request_id,
    # priority, admitted] per request (admitted: the engine took it on, its chunks run before any
    # waiting prompt's): the conductor counts a placement as pending until a report names it here.
    queued: list[list[Any]] = field(default_factory=list)
    # Running decodes, one [context_tokens, remaining_max_tokens] per sequence.
    decoding: list[list[int]] = field(default_factory=list)
    # Measurements since the previous report:
    prefills: list[list[Any]] = field(default_factory=list)  # [prompt_len, reused_prefix_len, seconds]
    steps: list[list[Any]] = field(default_factory=list)  # decode-only steps: [batch, kv_tokens, seconds]
    transfers: list[list[Any]] = field(default_factory=list)  # KV moved in: [bytes, seconds]
