"""What a new grammar's compile costs the requests already running, off the step and on it.

    .venv/bin/python loadtests/bench_grammar_compile.py [--model DIR] [--rounds 3] [--out FILE.json]

A structured-output request whose grammar the engine has not compiled yet (a JSON schema it has not
seen) needs a matcher compiled against the model's tokenizer: ~1 ms for a small schema, hundreds of
milliseconds for a large one. The engine compiles it on a thread of its own while it steps the
other requests (``LLMEngine.add_request``; llguidance releases the GIL), and admits the request
once it is done. The plain path, measured beside it in the same run, compiles on the step's own
thread before the request is added, as the engine did before (and as it still does for a
grammar passed through ``Grammars.matcher``).

Each round: eight greedy requests decode on the demo model (or ``--model``); after ten steps a
request arrives with a JSON schema of N objects (each of ten string fields with a pattern), new
to the engine (its keys carry the round's number, so no cache holds it). Per schema size and mode,
the medians over ``--rounds`` (modes alternating) of: the running requests' step gap before the
arrival (the time between two steps' ends), the longest gap from the arrival until the new
request's first token (the stall the running requests see), and that first token's latency
from the arrival. Printed with the ratio on the step / off the step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from yutu.engine.engine import EngineConfig, LLMEngine
from yutu.engine.model_source import resolve_model
from yutu.engine.sampling import SamplingParams
from yutu.engine.structured import grammar_from

RUNNING = 8  # requests decoding when the new one arrives
STEPS_BEFORE = 10  # steps measured before it arrives
MODES = ("off the step", "on the step")


def schema(objects: int, tag: str) -> dict[str, object]:
    """A JSON schema of ``objects`` objects of ten patterned strings each (~640 bytes an object),
    all required (hundreds of optional ones are past llguidance's parser limits)."""
    fields = {f"g{j}": {"type": "string", "pattern": "[a-z]{3,9}"} for j in range(10)}
    inner = {"type": "object", "properties": fields, "required": list(fields)}
    keys = [f"{tag}_{i}" for i in range(objects)]
    return {"type": "object", "properties": dict.fromkeys(keys, inner), "required": keys}


def one_round(engine: LLMEngine, grammar: str, mode: str, tag: str, vocab: int) -> dict[str, float]:
    rng = random.Random(tag)
    free = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(RUNNING):
        engine.add_request(f"{tag}-free{i}", [rng.randrange(10, vocab) for _ in range(64)], free)
    started: set[str] = set()
    while len(started) < RUNNING:  # every running request past its prompt
        started |= {out.request_id for out in engine.step()}
    gaps = []
    last = time.perf_counter()
    for _ in range(STEPS_BEFORE):
        engine.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    arrival = time.perf_counter()
    if mode == "on the step":
        engine.grammars.matcher(grammar)  # the plain path: compiled here, between two steps
    params = SamplingParams(temperature=0, max_tokens=8, grammar=grammar)
    engine.add_request(f"{tag}-json", [rng.randrange(10, vocab) for _ in range(64)], params)
    stall = 0.0
    first_token = None
    while first_token is None:
        outs = engine.step()
        now = time.perf_counter()
        stall = max(stall, now - last)
        last = now
        for out in outs:
            if out.request_id == f"{tag}-json":
                assert not out.failed, out.error
                first_token = now - arrival
    engine.abort_all()
    return {"gap_ms": statistics.median(gaps) * 1e3, "stall_ms": stall * 1e3, "ttft_ms": first_token * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the built-in demo model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a decode engine's default: 1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per schema size and mode")
    parser.add_argument("--objects", default="10,100,1000", help="schema sizes, in objects (comma-separated)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    engine = LLMEngine(EngineConfig(model_dir=model_dir, max_num_seqs=RUNNING + 1))
    vocab = engine.model_config.vocab_size
    one_round(engine, grammar_from("json_schema", schema(1, "warm")), "on the step", "warm", vocab)
    results = []
    print(f"{RUNNING} requests decoding, torch threads {args.threads}, {args.rounds} rounds per mode")
    print(f"{'schema':>16} {'mode':>13} {'step gap ms':>12} {'stall ms':>9} {'new TTFT ms':>12}")
    for objects in [int(n) for n in args.objects.split(",")]:
        rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        size = 0
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                spec = schema(objects, f"r{objects}x{r}{mode[:3]}")
                size = len(json.dumps(spec))
                rows[mode].append(
                    one_round(engine, grammar_from("json_schema", spec), mode, f"{objects}-{r}-{mode}", vocab)
                )
        medians = {
            mode: {key: statistics.median(row[key] for row in rows[mode]) for key in rows[mode][0]}
            for mode in MODES
        }
        for mode in MODES:
            m = medians[mode]
            label = f"{objects} obj, {size / 1024:.0f} KB"
            print(f"{label:>16} {mode:>13} {m['gap_ms']:>12.2f} {m['stall_ms']:>9.1f} {m['ttft_ms']:>12.1f}")
        on, off = medians["on the step"], medians["off the step"]
        print(
            f"{'':>16} {'on / off':>13} {'':>12} {on['stall_ms'] / off['stall_ms']:>8.1f}x"
            f" {on['ttft_ms'] / off['ttft_ms']:>11.2f}x"
        )
        results.append({"objects": objects, "schema_bytes": size, **{mode: medians[mode] for mode in MODES}})
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
