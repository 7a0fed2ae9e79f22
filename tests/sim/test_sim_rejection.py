"""The three overload modes on two scripted requests (sim_support's exact profile, a decode step
of batch/16 s, TBT SLO 0.1 s: one sequence per step fits, two do not).

r0 arrives at 0 (9 tokens), first token at 1.125, KV at the decode at 1.265625. r1 arrives at 0.5
(5 tokens) behind it on the one prefill instance: predicted TTFT 0.625 (r0's 5 tokens left) + 0.625,
first token at 1.75, KV at 1.828125.

- r0 decodes 2 tokens (done at 1.390625, before r1's KV comes): *predicted* forecasts r0 gone when
  r1's prefill ends and accepts r1, which then decodes alone; *early* counts r0 as staying and
  rejects r1 on TBT (2/16 s > 0.1 s); *after_prefill* accepts it.
- r0 decodes 19 tokens (until 2.453125): predicted and early both reject r1 at once; after_prefill
  prefills it and its decode refuses it when its KV arrives: 0.625 s of prefill wasted.
"""

from __future__ import annotations

import pytest
from yutu.sim.config import Rejection, SimConfig
from yutu.sim.simulator import Simulation
from yutu.sim.summary import summarise

from tests.sim.sim_support import req, tiny_profile


def run(mode: Rejection, r0_output: int) -> Simulation:
    trace = [req(0, 0.0, 9, r0_output, [1, 2, 3]), req(1, 0.5, 5, 3, [7, 8])]
    config = SimConfig(prefill=1, decode=1, profile=tiny_profile(decode=(0.0, 2.0**-4, 0.0)), slo_ttft_s=100.0,
                       slo_tbt_s=0.1, rejection=mode)  # fmt: skip
    sim = Simulation(config, trace)
    sim.run()
    return sim


@pytest.mark.parametrize(
    ("mode", "rejected"),
    [(Rejection.PREDICTED, None), (Rejection.EARLY, "tbt_slo"), (Rejection.AFTER_PREFILL, None)],
)
def test_a_decode_that_empties_in_time(mode: Rejection, rejected: str | None) -> None:
    sim = run(mode, 3)
    r1 = sim.records[1]
    assert r1.rejected == rejected
    if rejected is None:
        assert (r1.ttft_s, r1.tbt_s, r1.finish_s) == (1.25, 0.0625, 1.75 + 5 / 64 + 2 * 0.0625)
        assert r1.predicted_ttft_s == 1.25
    assert sim.wasted_prefill_s == 0.0


@pytest.mark.parametrize("mode", [Rejection.PREDICTED, Rejection.EARLY, Rejection.AFTER_PREFILL])
def test_a_decode_still_busy_when_the_kv_comes(mode: Rejection) -> None:
    sim = run(mode, 20)
    r1 = sim.records[1]
    s = summarise(sim)
    if mode is Rejection.AFTER_PREFILL:
        assert (r1.rejected, r1.ttft_s, sim.wasted_prefill_s) == ("decode_tbt", 1.25, 0.625)
        assert s["rejected_by_cause"] == {"decode_tbt": 1} and s["wasted_prefill_s"] == 0.625
    else:
        assert (r1.rejected, r1.first_token_s, sim.wasted_prefill_s) == ("tbt_slo", None, 0.0)
    assert sim.records[0].finish_s == 1.265625 + 19 * 0.0625  # r0 never shares a step
    assert s["good"] == 1 and s["slo_attainment"] == 0.5
