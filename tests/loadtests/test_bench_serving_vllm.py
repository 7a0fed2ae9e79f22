"""bench_serving's vLLM peer: the comparison's rules always, the real vLLM CPU server when it is there.

The rules (no vLLM needed): which configuration is the better one per figure and the ratio
stack / better, the order in which stacks and vLLM configurations take turns, what each
configuration sets in vLLM's environment and what of the caller's it drops, and ``--vllm``'s
choices. With the virtualenv of ``loadtests/setup_vllm.sh`` (skipped with the reason otherwise):
``bench_serving --quick --vllm auto`` measures every scenario and figure through both vLLM
configurations beside the stack, runs vLLM's own client against all three, and stops every
server, and a peer whose starter is SIGKILLed still goes away by itself.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from yutu.engine.default_model import ensure_default_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "loadtests"))

from bench_serving import EXTRA_ROWS, ROWS, compare_to_vllm, turns, vllm_python  # noqa: E402
from vllm_peer import clean_environ, config_env, default_python, find_tcmalloc  # noqa: E402

FIGURES = {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms"}
needs_vllm = pytest.mark.skipif(
    not default_python().exists(),
    reason=f"no vLLM virtualenv at {default_python()} (loadtests/setup_vllm.sh)",
)


def _figures(base: float) -> dict[str, dict[str, float]]:
    """Every scenario's figures, each ``base`` times its row number (so rows differ)."""
    out: dict[str, dict[str, float]] = {}
    for i, (scen, fig) in enumerate(ROWS, start=1):
        out.setdefault(scen, {})[fig] = base * i
    return out


def test_the_better_configuration_is_the_lower_time_and_the_higher_throughput() -> None:
    stack = _figures(2.0)
    default, tuned = _figures(1.0), _figures(4.0)
    default["concurrent"]["tok_s"], tuned["concurrent"]["tok_s"] = 500.0, 800.0  # stack: 2 x 6 = 12
    rows = compare_to_vllm(stack, {"default": default, "tuned": tuned})
    assert list(rows) == [f"{scen}/{fig}" for scen, fig in ROWS]
    for i, (scen, fig) in enumerate(ROWS, start=1):
        row = rows[f"{scen}/{fig}"]
        if fig == "tok_s":
            assert row == {"stack": 12.0, "default": 500.0, "tuned": 800.0, "best": "tuned", "ratio": 12.0 / 800.0,
                           "ahead": False}  # fmt: skip
        else:  # times: default (1 x i) beats tuned (4 x i); the stack (2 x i) is twice default's
            assert row == {"stack": 2.0 * i, "default": 1.0 * i, "tuned": 4.0 * i, "best": "default",
                           "ratio": 2.0, "ahead": False}  # fmt: skip
    ahead = compare_to_vllm(_figures(0.5), {"default": default, "tuned": tuned})
    assert all(r["ahead"] for k, r in ahead.items() if k != "concurrent/tok_s")
    assert ahead["sequential/ttft_p50_ms"]["ratio"] == 0.5


def test_the_extra_rows_compare_where_every_side_measured_them_a_higher_share_winning() -> None:
    stack, default, tuned = _figures(2.0), _figures(1.0), _figures(4.0)
    stack["trace"] = {"slo_share": 0.9, "ttft_p50_ms": 400.0, "tbt_p99_ms": 50.0}
    default["trace"] = {"slo_share": 0.2, "ttft_p50_ms": 900.0, "tbt_p99_ms": 300.0}
    tuned["trace"] = {"slo_share": 0.6, "ttft_p50_ms": 500.0, "tbt_p99_ms": 150.0}
    stack["vllm_client"] = {"tok_s": 1000.0, "tpot_p50_ms": 8.0}  # vLLM's client not run against tuned
    default["vllm_client"] = {"tok_s": 900.0, "tpot_p50_ms": 9.0}
    rows = compare_to_vllm(stack, {"default": default, "tuned": tuned})
    assert list(rows) == [f"{s}/{f}" for s, f in ROWS] + [f"{s}/{f}" for s, f in EXTRA_ROWS if s == "trace"]
    assert rows["trace/slo_share"] == {"stack": 0.9, "default": 0.2, "tuned": 0.6, "best": "tuned", "ratio": 1.5,
                                       "ahead": True}  # fmt: skip
    assert rows["trace/ttft_p50_ms"]["best"] == "tuned" and rows["trace/ttft_p50_ms"]["ahead"]
    assert rows["trace/tbt_p99_ms"]["ratio"] == 50.0 / 150.0


def test_stacks_and_vllm_configurations_take_turns_a_stack_first() -> None:
    assert turns(["mixed", "disagg"], ["default", "tuned"]) == [
        ("stack", "mixed"), ("vllm", "default"), ("stack", "disagg"), ("vllm", "tuned")]  # fmt: skip
    assert turns(["mixed"], ["default", "tuned"]) == [
        ("stack", "mixed"),
        ("vllm", "default"),
        ("vllm", "tuned"),
    ]
    assert turns(["mixed", "disagg"], []) == [("stack", "mixed"), ("stack", "disagg")]


def test_default_sets_only_the_kv_cache_and_tuned_binds_every_cpu_with_tcmalloc() -> None:
    assert config_env("default", [0, 1], 1) == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    try:
        tcmalloc = str(find_tcmalloc())
    except Exception as err:  # without Debian's libtcmalloc-minimal4, tuned refuses to start
        with pytest.raises(type(err), match="apt-get install libtcmalloc-minimal4"):
            config_env("tuned", [0, 1], 1)
        return
    assert config_env("tuned", [0, 1, 3], 2) == {
        "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1,3",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "LD_PRELOAD": tcmalloc}  # fmt: skip
    assert tcmalloc.endswith("libtcmalloc_minimal.so.4")


def test_the_callers_vllm_openmp_and_project_variables_are_not_passed_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "KMP_AFFINITY", "GOMP_CPU_AFFINITY",
                 "LD_PRELOAD", "PYTHONPATH", "VIRTUAL_ENV"):  # fmt: skip
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("BENCH_KEEP_ME", "y")
    env = clean_environ()
    assert not {k for k in env if k.startswith(("VLLM_", "OMP_", "KMP_", "GOMP_"))}
    assert not {"LD_PRELOAD", "PYTHONPATH", "VIRTUAL_ENV"} & set(env)
    assert env["BENCH_KEEP_ME"] == "y"


def test_vllm_choice_off_auto_without_a_venv_and_a_missing_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert vllm_python("off") is None
    monkeypatch.setenv("YUTU_VLLM_VENV", str(tmp_path / "none"))
    assert vllm_python("auto") is None
    assert f"vLLM peer skipped: no {tmp_path / 'none' / 'bin' / 'python'}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such interpreter"):
        vllm_python(str(tmp_path / "python"))
    assert vllm_python(sys.executable) == Path(sys.executable)


def _api_servers_on(port: int) -> list[int]:
    """Pids of live vLLM API servers listening on ``port`` (by command line)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and str(port).encode() in argv:
            pids.append(int(cmdline.parent.name))
    return pids


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@needs_vllm
def test_the_quick_run_measures_both_vllm_configurations_beside_the_stack(tmp_path: Path) -> None:
    ensure_default_model()
    out = tmp_path / "bench_serving.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "loadtests" / "bench_serving.py"), "--stacks", "mixed", "--quick",
         "--vllm", "auto", "--client-runs", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=1500, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["vllm"]) == {"default", "tuned"}
    assert [t["run"] for t in res["timeline"]] == ["mixed", "vllm default", "vllm tuned"]
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert res["vllm"]["default"]["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert res["vllm"]["tuned"]["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus,
                                           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "LD_PRELOAD": str(find_tcmalloc())}  # fmt: skip
    for run in res["vllm"].values():
        assert run["version"] == "0.32.0" and run["startup_s"] > 0
        assert set(run["server"]) == {"sequential", "cached", "concurrent"}
        client = run["extra"]["vllm_client"]  # vLLM's own client against it too, the median of two runs
        assert set(client) == {"tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms"} and client["tok_s"] > 0, (
            client
        )
        runs = run["extra"]["vllm_client_runs"]
        assert len(runs) == 2 and all(set(r) == set(client) for r in runs)
        assert client == {f: statistics.median([r[f] for r in runs]) for f in client}
        for scenario, figures in run["server"].items():
            assert set(figures) == FIGURES | ({"tok_s"} if scenario == "concurrent" else set())
            # an ITL may be 0: vLLM's server sends the tokens it has in one event when the client lags
            assert all(v > 0 for f, v in figures.items() if not f.startswith("itl")), (scenario, figures)
            assert figures["itl_p99_ms"] >= figures["itl_p50_ms"] >= 0, (scenario, figures)
        assert _api_servers_on(int(run["url"].rsplit(":", 1)[1])) == []  # stopped again
    rows = res["vs_vllm"]["mixed"]
    assert len(rows) == len(ROWS) + 2  # and vLLM's client's throughput and TPOT
    assert set(res["stacks"]["mixed"]["extra"]["vllm_client"]) == set(client)
    stack = res["stacks"]["mixed"]["stack"] | res["stacks"]["mixed"]["extra"]
    peers = {c: r["server"] | r["extra"] for c, r in res["vllm"].items()}
    assert rows == compare_to_vllm(stack, peers)
    for key, row in rows.items():
        scen, fig = key.split("/")
        line = f"  {scen:<12}{fig:<13}{row['stack']:>10.2f}{row['default']:>14.2f}{row['tuned']:>14.2f}"
        assert (
            f"{line}{row['ratio']:>11.2f}x  {'yes' if row['ahead'] else 'no'} (best: {row['best']})"
            in proc.stdout
        )
    ahead = sum(r["ahead"] for r in rows.values())
    assert f"mixed ahead of the better vLLM configuration on {ahead} of {len(rows)} rows" in proc.stdout
    assert "vLLM's own client (vllm_client), medians of 2 runs:" in proc.stdout


@needs_vllm
def test_a_peer_whose_starter_is_killed_goes_away_by_itself(tmp_path: Path) -> None:
    """vllm_peer.py serves token-id prompts; SIGKILL of it (no cleanup runs) still ends vLLM's group."""
    model = ensure_default_model()
    starter = subprocess.Popen(
        [sys.executable, str(ROOT / "loadtests" / "vllm_peer.py"), str(model), "--log", str(tmp_path / "v.log")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    card: dict[str, Any] = {}
    try:
        assert starter.stdout is not None
        card = json.loads(starter.stdout.readline())
        body = {"model": card["model"], "prompt": [11, 12, 13, 14], "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        reply = httpx.post(f"{card['url']}/v1/completions", json=body, timeout=120).json()
        assert len(reply["choices"][0]["logprobs"]["tokens"]) == 5
        assert all(t.startswith("token_id:") for t in reply["choices"][0]["logprobs"]["tokens"])
        assert _group_members(card["pid"])  # the API server and its engine run in their own group
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 90
        while _group_members(card["pid"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _group_members(card["pid"]) == []
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        if starter.stdout is not None:
            starter.stdout.close()
        if card and _group_members(card["pid"]):  # the failure above: still, leave nothing running
            os.killpg(card["pid"], signal.SIGKILL)
