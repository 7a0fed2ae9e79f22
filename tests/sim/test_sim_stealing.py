"""Prefill stealing in the simulator: a burst on one prefill and one decode instance."""

from __future__ import annotations

from yutu.sched import QueuedPrefill
from yutu.sim.config import SimConfig
from yutu.sim.simulator import Simulation
from yutu.sim.trace import make_request

from tests.sim.sim_support import tiny_profile

# 512-token prompts in 1/16 s each, a decode step of 2**-8 s + 2**-11 s per sequence.
PROFILE = tiny_profile(block_size=16, prefill=(0.0, 2.0**-13, 0.0), decode=(2.0**-8, 2.0**-11, 0.0),
                       network_bps=2.0**30, max_batch=32, decode_kv_blocks=10_000, prefill_kv_blocks=10_000)  # fmt: skip


def burst(stealing: bool, until: float | None = None) -> Simulation:
    trace = [make_request(i, i / 2048, 512, 64, tuple(range(1000 * i, 1000 * i + 32)), 16) for i in range(16)]
    sim = Simulation(SimConfig(prefill=1, decode=1, profile=PROFILE, prefill_stealing=stealing), trace)
    sim.run(until=until)
    return sim


def test_a_burst_finishes_sooner_when_the_decode_takes_some_prefills() -> None:
    off, on = burst(False), burst(True)
    local = [r.index for r in on.records.values() if r.prefill_id is None]
    assert [r for r in off.records.values() if r.prefill_id is None] == []
    assert local == [1, 4, 8, 12]  # the second arrival finds the prefill queued and the decode idle
    finish = {name: max(r.finish_s for r in sim.records.values()) for name, sim in (("off", off), ("on", on))}
    assert finish["on"] < 0.9 * finish["off"]
    ttft_on = sorted(r.ttft_s for r in on.records.values())
    ttft_off = sorted(r.ttft_s for r in off.records.values())
    assert ttft_on[8] < ttft_off[8] and ttft_on[-1] < ttft_off[-1]


def test_the_view_lists_the_prefills_a_decode_took_on() -> None:
    sim = burst(True, until=2 / 2048)  # the second request is placed on the decode, not yet run
    assert sim.view(2 / 2048).decodes[0].prefills == (QueuedPrefill(512),)
