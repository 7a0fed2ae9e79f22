"""``yutu simulate`` end to end on a small trace: the files it writes, and determinism per seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from yutu.cli import main

from tests.sim.sim_support import tiny_profile, write_trace

SUMMARY_KEYS = {
    "ttft_mean_s",
    "ttft_p99_s",
    "tbt_p99_s",
    "goodput_rps",
    "cache_hit_ratio",
    "rejected",
    "requests",
}


def trace(tmp_path: Path) -> Path:
    """40 requests, 250 ms apart, sharing a 2-block system prompt; every third one repeats a chat."""
    rows = []
    for i in range(40):
        ids = [1, 2] + ([100 + i % 3, 200 + i % 3] if i % 3 == 0 else [1000 + i, 2000 + i]) + [5000 + i]
        rows.append((250 * i, 4 * len(ids) - 1, 3 + i % 5, ids))
    return write_trace(tmp_path / "trace.jsonl", rows)


def simulate(tmp_path: Path, out: str, *extra: str) -> Path:
    profile = tmp_path / "tiny.json"
    profile.write_text(tiny_profile(prefill=(0.0, 2.0**-6, 0.0)).to_json())
    argv = ["simulate", "--trace", str(trace(tmp_path)), "--prefill", "2", "--decode", "2",
            "--profile", str(profile), "--out", str(tmp_path / out), *extra]  # fmt: skip
    assert main(argv) == 0
    return tmp_path / out


def test_simulate_writes_the_summary_records_timeline_and_plots(tmp_path: Path) -> None:
    out = simulate(tmp_path, "run", "--slo-ttft-ms", "1000", "--slo-tbt-ms", "200")
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["requests"] == 40 and summary["completed"] + summary["rejected"] == 40
    assert summary["config"]["policy"] == "kvcentric" and summary["slo_ttft_s"] == 1.0
    assert 0 < summary["cache_hit_ratio"] < 1  # the shared system prompt and the repeated chats hit
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(40))
    assert all(r["ttft_s"] > 0 for r in records if r["rejected"] is None)
    for name in ("load.png", "latency.png", "replicas.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_runs_with_one_seed_give_identical_json(tmp_path: Path) -> None:
    a = simulate(tmp_path, "a", "--jitter", "0.3", "--seed", "7", "--no-plots")
    b = simulate(tmp_path, "b", "--jitter", "0.3", "--seed", "7", "--no-plots")
    c = simulate(tmp_path, "c", "--jitter", "0.3", "--seed", "8", "--no-plots")
    for name in ("summary.json", "requests.jsonl", "timeline.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "requests.jsonl").read_bytes() != (c / "requests.jsonl").read_bytes()  # the seed matters


def test_options_come_from_the_environment_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YUTU_SIMULATE_POLICY", "round_robin")
    monkeypatch.setenv("YUTU_SIMULATE_PLOTS", "0")
    out = simulate(tmp_path, "env")
    assert json.loads((out / "summary.json").read_text())["config"]["policy"] == "round_robin"
    assert not (out / "load.png").exists()


def test_bad_options_and_traces_exit_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate"]) == 2
    assert "--trace FILE is required" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "bad trace" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(trace(tmp_path)), "--decode", "0"]) == 2
    assert "need --prefill >= 0 and --decode >= 1" in capsys.readouterr().err


def test_learned_cost_models_converge_to_the_profile(tmp_path: Path) -> None:
    """--learn-costs: the policy starts from the conductor's untrusted priors and is fed the
    simulated measurements as a conductor is fed load reports; on exact data it fits the profile."""
    from yutu.sim.config import SimConfig
    from yutu.sim.simulator import Simulation
    from yutu.sim.trace import load_trace

    profile = tiny_profile(prefill=(0.0, 2.0**-6, 2.0**-12), decode=(2.0**-5, 2.0**-9, 2.0**-12))
    requests = load_trace(trace(tmp_path), block_size=4)
    # One decode instance, so steps of batch 1 and 2 are measured (on two, the TBT forecast over each
    # request's lifetime keeps these short requests apart: every step would run one sequence).
    sim = Simulation(SimConfig(prefill=2, decode=1, profile=profile, learn_costs=True), requests)
    assert not sim.costs.prefill.calibrated
    sim.run()
    assert sim.costs.prefill.calibrated and sim.costs.decode.calibrated
    assert sim.costs.prefill.coefficients == pytest.approx(profile.prefill, rel=1e-6, abs=1e-12)
    assert sim.costs.decode.coefficients == pytest.approx(profile.decode, rel=1e-6, abs=1e-12)
    # Without local caches every reuse is a store read, each one observed by the transfer model.
    sim = Simulation(
        SimConfig(prefill=2, decode=2, profile=profile, learn_costs=True, cache_blocks=0), requests
    )
    sim.run()
    fetched = sum(1 for r in sim.records.values() if r.fetched_blocks)
    assert sim.costs.transfer.num_samples == fetched > 0
    assert sim.costs.transfer.bandwidth_bps < 2e9 / 16  # on its way from the prior down to 1 KiB/s
