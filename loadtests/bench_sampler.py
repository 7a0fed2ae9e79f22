"""The sampler's step cost, against the plain version it replaced, in the same run.

    .venv/bin/python loadtests/bench_sampler.py [--threads 1] [--rounds 30] [--out bench_sampler.json]

Random sampling (temperature > 0: OpenAI's default), rows ``free`` (temperature 0.8 alone) and
``top_p`` (also top_p 0.95): ``plain`` sends every random row through top-k/top-p (a
vocabulary-wide sort per row) and draws it with ``torch.multinomial`` (an exponential for every
token of the row); ``Sampler``, the engine's sampler, sends only rows that ask for top-k or top-p
through them, from the row's largest values where those decide it
(``yutu.engine.sampler.top_k_top_p``), and draws a row by inverse transform from one uniform
(``yutu.engine.sampler.draw_from``).

Greedy sampling, rows ``greedy`` and ``greedy_logprobs`` (the sampled token's logprob, as the
serving bench asks): ``plain`` is the sampler on torch's operations (``Sampler()``, the reference:
``argmax``, ``log_softmax``), ``Sampler`` the engine's on CPU, with the native kernels' row
reductions (``Sampler(kernels)``, ``greedy_rows``: finiteness, first maximum, log-normaliser).

What a bias and the penalties cost, rows ``penalized`` (greedy with a 10-token ``logit_bias``,
``repetition_penalty`` 1.1, ``frequency_penalty`` and ``presence_penalty`` 0.5, over a history
of 1,000 prompt and 200 output tokens): the engine's sampler on those rows against the same rows
plain greedy, printed as the ratio with / without.

What a grammar costs (structured outputs), rows ``constrained`` (greedy, every row with a grammar
allowing a random half of the vocabulary): the sampler with the bitmask against plain greedy; the
mask alone on torch's operations (``yutu.engine.structured.mask_rows_``) against the native
kernel; and ``fill us``, llguidance computing one row's bitmask for a JSON schema mid-string, with
what building the tokenizer view and compiling the schema cost (the demo model's tokenizer at
2,560 tokens; at the other widths a synthetic byte-level BPE vocabulary of that size, seeded, as
none is at hand here).

Shapes: a batch of 1 and 16 rows over the demo model's vocabulary (2,560), Llama-2's (32,000) and
Llama-3's (128,256). Each figure is the median of ``--rounds`` calls, the two versions taking
turns; printed with the ratio plain / Sampler.
"""

from __future__ import annotations

import argparse
import array
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from yutu.engine import native
from yutu.engine.default_model import ensure_default_model
from yutu.engine.model_config import ModelConfig
from yutu.engine.sampler import (
    Sampler,
    TokenHistory,
    adjust_logits,
    adjust_logits_native,
    apply_top_k_top_p,
    scale_by_temperature,
)
from yutu.engine.sampling import SamplingParams
from yutu.engine.structured import Grammars, grammar_from, mask_rows_

VOCABS = (2_560, 32_000, 128_256)
BATCHES = (1, 16)


def plain_sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The sampler's random path as it was: mask every row, then torch.multinomial."""
    vocab = logits.shape[1]
    temps = torch.tensor([p.temperature for p in params])
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    probs = apply_top_k_top_p(scale_by_temperature(logits.float(), temps), top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1).squeeze(1)


def median_us(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    for fn in fns.values():  # warm
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


PENALIZED = SamplingParams(
    temperature=0.0,
    logit_bias=tuple((t, 1.0) for t in range(10)),
    repetition_penalty=1.1,
    frequency_penalty=0.5,
    presence_penalty=0.5,
)


DEMO_VOCAB = 2_560
GUIDED = SamplingParams(
    temperature=0.0,
    grammar=grammar_from(
        "json_schema",
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    ),
)


def penalties(sampler: Sampler, kernels: ModuleType, rounds: int) -> list[dict[str, object]]:
    """The ``penalized`` rows: the sampler with a bias and penalties against without (same logits),
    and the adjustment alone on torch's operations against the native kernel."""
    rows: list[dict[str, object]] = []
    print(f"\n{'rows':>16} {'vocab':>8} {'batch':>5} {'without us':>10} {'with us':>8} {'with/without':>13}"
          f" {'torch us':>9} {'native us':>9} {'torch/native':>13}")  # fmt: skip
    for vocab in VOCABS:
        for batch in BATCHES:
            logits = torch.randn(batch, vocab) * 4
            histories: list[TokenHistory | None] = [  # kept as the engine keeps them (Sequence.token_array)
                TokenHistory(array.array("q", torch.randint(0, vocab, (1_200,)).tolist()), 1_000)
                for _ in range(batch)
            ]
            gens: list[torch.Generator | None] = [None] * batch
            params = [PENALIZED] * batch
            got = median_us(
                {
                    "without": partial(
                        sampler.sample, logits, [SamplingParams(temperature=0.0)] * batch, gens
                    ),
                    "with": partial(sampler.sample, logits, params, gens, histories),
                    "torch": partial(adjust_logits, logits, params, histories),
                    "native": partial(adjust_logits_native, kernels, logits, params, histories),
                },
                rounds,
            )
            cost, gain = got["with"] / got["without"], got["torch"] / got["native"]
            rows.append({"rows": "penalized", "vocab": vocab, "batch": batch, **got, "with_over_without": cost,
                         "torch_over_native": gain})  # fmt: skip
            print(f"{'penalized':>16} {vocab:>8} {batch:>5} {got['without']:>10.0f} {got['with']:>8.0f} {cost:>12.2f}x"
                  f" {got['torch']:>9.0f} {got['native']:>9.0f} {gain:>12.2f}x")  # fmt: skip
    return rows


def constrained(sampler: Sampler, kernels: ModuleType, rounds: int) -> list[dict[str, object]]:
    """The ``constrained`` rows: the sampler with a grammar's bitmask against without (same
    logits), and what llguidance costs at each vocabulary (:func:`grammar_costs`)."""
    rows: list[dict[str, object]] = []
    print(f"\n{'rows':>16} {'vocab':>8} {'batch':>5} {'without us':>10} {'with us':>8} {'with/without':>13}"
          f" {'torch us':>9} {'native us':>9} {'torch/native':>13} {'fill us':>8}")  # fmt: skip
    costs = {vocab: grammar_costs(vocab, rounds) for vocab in VOCABS}
    for vocab in VOCABS:
        for batch in BATCHES:
            logits = torch.randn(batch, vocab) * 4
            allowed = torch.randint(0, 2, (batch, (vocab + 31) // 32 * 32), dtype=torch.int64)
            words = (allowed.view(batch, -1, 32) << torch.arange(32)).sum(-1)
            bitmask = (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)
            gens: list[torch.Generator | None] = [None] * batch
            got = median_us(
                {
                    "without": partial(
                        sampler.sample, logits, [SamplingParams(temperature=0.0)] * batch, gens
                    ),
                    "with": partial(sampler.sample, logits, [GUIDED] * batch, gens, None, bitmask),
                    "torch": partial(masked, None, logits, bitmask),
                    "native": partial(masked, kernels, logits, bitmask),
                },
                rounds,
            )
            cost, gain = got["with"] / got["without"], got["torch"] / got["native"]
            rows.append({"rows": "constrained", "vocab": vocab, "batch": batch, **got, "with_over_without": cost,
                         "torch_over_native": gain, **costs[vocab]})  # fmt: skip
            shown = f"{costs[vocab]['fill_us']:.1f}"
            print(f"{'constrained':>16} {vocab:>8} {batch:>5} {got['without']:>10.0f} {got['with']:>8.0f}"
                  f" {cost:>12.2f}x {got['torch']:>9.0f} {got['native']:>9.0f} {gain:>12.2f}x {shown:>8}")  # fmt: skip
    for vocab, c in costs.items():
        print(f"{'grammar':>16} {vocab:>8}  tokenizer view {c['view_s']:.2f} s, schema compiled in"
              f" {c['compile_ms']:.1f} ms, one row's bitmask {c['fill_us']:.1f} us")  # fmt: skip
    return rows


def masked(kernels: ModuleType | None, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` with every row masked by ``bitmask``: on torch's operations, or native."""
    scores = logits.clone()
    if kernels is None:
        mask_rows_(scores, range(len(scores)), bitmask)
    else:
        kernels.mask_rows_(scores, torch.arange(len(scores)), bitmask)
    return scores


def synthetic_tokenizer(vocab: int, directory: Path) -> Path:
    """A directory holding a byte-level BPE ``tokenizer.json`` of ``vocab`` tokens (id 0 an eos),
    whose merges join a random token with a letter or a short token (seeded): a stand-in for a
    real vocabulary of that size (the demo model's is the only one at hand here)."""
    rng = random.Random(vocab)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    table: dict[str, int] = {"<|eos|>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    tokens, merges = list(alphabet), []
    short = [c for c in alphabet if c.isascii() and c.isalpha()] + ["\u0120"]  # letters and the space
    while len(table) < vocab:
        left = rng.choice(tokens[-2_000:] if rng.random() < 0.5 else tokens)
        right = rng.choice(short if rng.random() < 0.7 else tokens[: len(alphabet) + 2_000])
        if len(left) + len(right) > 16 or left + right in table:
            continue
        table[left + right] = len(table)
        tokens.append(left + right)
        merges.append((left, right))
    tokenizer = HFTokenizer(models.BPE(table, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|eos|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def grammar_costs(vocab: int, rounds: int) -> dict[str, float]:
    """At ``vocab`` tokens (the demo model's tokenizer at its size, else a synthetic one): building
    the tokenizer view (once per engine), compiling the bench's schema (once per grammar), and
    one row's bitmask inside a JSON string (the widest choice: most tokens may come next)."""
    with tempfile.TemporaryDirectory() as scratch:
        if vocab == DEMO_VOCAB:
            model_dir = ensure_default_model()
            eos = ModelConfig.from_dir(model_dir).eos_token_ids
        else:
            model_dir, eos = synthetic_tokenizer(vocab, Path(scratch)), (0,)
        started = time.perf_counter()
        grammars = Grammars(model_dir, vocab, eos)  # builds the tokenizer view
        view_s = time.perf_counter() - started
        started = time.perf_counter()
        grammar = grammars.matcher(GUIDED.grammar or "")
        compile_ms = (time.perf_counter() - started) * 1e3
        for token in (
            HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
            .encode('{"name": "The jade', add_special_tokens=False)
            .ids
        ):
            grammar.advance(token)
    row = torch.zeros(grammars.bitmask_words, dtype=torch.int32)

    def hundred() -> None:
        for _ in range(100):
            grammar.fill_bitmask(row)

    fill = median_us({"fill": hundred}, rounds)["fill"] / 100
    return {"view_s": view_s, "compile_ms": compile_ms, "fill_us": fill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a decode engine's default: 1)")
    parser.add_argument("--rounds", type=int, default=30, help="calls of each version per shape")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernels = native.load()  # built by `make`
    sampler = Sampler(kernels)  # the engine's, on CPU
    reference = Sampler()  # on torch's operations: the plain version of the greedy rows
    rows = []
    print(f"{'rows':>16} {'vocab':>8} {'batch':>5} {'plain us':>10} {'Sampler us':>11} {'plain/Sampler':>14}")
    for name, row in (
        ("free", SamplingParams(temperature=0.8)),
        ("top_p", SamplingParams(temperature=0.8, top_p=0.95)),
        ("greedy", SamplingParams(temperature=0.0)),
        ("greedy_logprobs", SamplingParams(temperature=0.0, logprobs=0)),
    ):
        for vocab in VOCABS:
            for batch in BATCHES:
                logits = torch.randn(batch, vocab) * 4
                params = [row] * batch
                gens: list[torch.Generator | None] = [None] * batch
                plain: Callable[[], object] = (
                    partial(reference.sample, logits, params, gens)
                    if row.is_greedy
                    else partial(plain_sample, logits, params)
                )
                got = median_us({"plain": plain, "sampler": partial(sampler.sample, logits, params, gens)},
                                args.rounds)  # fmt: skip
                ratio = got["plain"] / got["sampler"]
                rows.append(
                    {"rows": name, "vocab": vocab, "batch": batch, **got, "plain_over_sampler": ratio}
                )
                print(
                    f"{name:>16} {vocab:>8} {batch:>5} {got['plain']:>10.0f} {got['sampler']:>11.0f} {ratio:>13.2f}x"
                )
    rows += penalties(sampler, kernels, args.rounds)
    rows += constrained(sampler, kernels, args.rounds)
    if args.out is not None:
        args.out.write_text(
            json.dumps({"threads": args.threads, "rounds": args.rounds, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
