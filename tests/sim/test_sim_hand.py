"""A tiny trace whose every TTFT, TBT and TPOT is computed by hand (sim_support's exact profile).

Two prefill instances, one decode, kvcentric, no SLO:

- r0 at 0 s, 9 tokens (blocks 1, 2 full; 3 partial), 3 output tokens. Nothing cached anywhere:
  both prefills predict 9/8 s; the tie goes to prefill-00. First token at 1.125 (TTFT 1.125).
  Blocks 1, 2 enter prefill-00's cache and the store. Handoff 9/64 s: the KV is at the decode at
  1.265625, the idle decode steps at once: tokens at 1.328125 and 1.390625. Gaps 0.203125 (first
  token to the decode's first: the handoff) and 0.0625 (one step): TBT (the decode's gaps, mean of
  the worst 10%: one gap) 0.0625, TPOT 0.1328125.
- r1 at 2 s, 41 tokens (10 new full blocks), 2 output tokens: both idle, tie, prefill-00, computed
  in 41/8 = 5.125 s. TTFT 5.125.
- r2 at 3 s, 9 tokens sharing blocks 1, 2 with r0. prefill-00 holds them but is busy: its queue is
  r1 with 8 of its 41 tokens done (1 s of 5.125), 33/8 s left, + 1/8 s for the one uncached token:
  4.25 s. prefill-01 fetches blocks 1, 2 from the store (2 * 2**-4 = 0.125 s < the 1 s it saves)
  and computes 1 token: 0.25 s. kvcentric takes prefill-01; TTFT 0.25 (fetched 2 blocks).
"""

from __future__ import annotations

from yutu.sim.config import SimConfig
from yutu.sim.simulator import Simulation
from yutu.sim.summary import significant, summarise

from tests.sim.sim_support import req, tiny_profile


def run() -> Simulation:
    trace = [
        req(0, 0.0, 9, 3, [1, 2, 3]),
        req(1, 2.0, 41, 2, list(range(10, 21))),
        req(2, 3.0, 9, 1, [1, 2, 6]),
    ]
    sim = Simulation(SimConfig(prefill=2, decode=1, policy="kvcentric", profile=tiny_profile()), trace)
    sim.run()
    return sim


def test_every_ttft_by_hand() -> None:
    sim = run()
    r0, r1, r2 = (sim.records[i] for i in range(3))
    assert (r0.prefill_id, r1.prefill_id, r2.prefill_id) == ("prefill-00", "prefill-00", "prefill-01")
    assert (r0.ttft_s, r1.ttft_s, r2.ttft_s) == (1.125, 5.125, 0.25)
    assert (r2.local_blocks, r2.fetched_blocks, r2.transfer_s, r2.prefill_s) == (0, 2, 0.125, 0.125)
    assert r2.predicted_ttft_s == 0.25  # the policy's estimate is exact on an exact profile
    assert (r0.handoff_s, r0.tbt_s, r0.tpot_s, r0.finish_s) == (0.203125, 0.0625, 0.1328125, 1.390625)
    # r1: first token 7.125, KV at 7.125 + 41/64, one decode step: only a handoff gap.
    assert r1.finish_s == 7.125 + 41 / 64 + 0.0625 and (r1.handoff_s, r1.tbt_s) == (41 / 64 + 0.0625, 0.0)
    # r2 emits only the prefill's token: done at its first token.
    assert (r2.finish_s, r2.tbt_s, r2.tpot_s) == (3.25, 0.0, 0.0)


def test_the_summary_of_the_hand_trace() -> None:
    s = summarise(run())
    assert (s["requests"], s["completed"], s["rejected"]) == (3, 3, 0)
    assert s["ttft_mean_s"] == significant((1.125 + 5.125 + 0.25) / 3)
    assert s["ttft_p99_s"] == 5.125
    # Reused: r2's 8 tokens of 59 prompt tokens, all from the store.
    assert (s["cache_hit_ratio"], s["local_hit_ratio"]) == (significant(8 / 59), 0.0)
    assert s["goodput_rps"] == 1.0  # 3 good requests over a 3 s arrival span (no SLO)
    assert s["prefill_compute_s"] == 1.125 + 5.125 + 0.25
