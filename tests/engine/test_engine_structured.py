"""Structured outputs in the engine: the mask on hand-made logits (both sampler paths), and a tiny
random Llama's outputs under JSON schemas, regexes, choices and Lark grammars, checked by parsing
them and, step by step, against transformers' logits masked by an independent matcher."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import llguidance
import pytest
import torch
from yutu.engine import structured
from yutu.engine.engine import FinishReason, LLMEngine, RequestOutput
from yutu.engine.errors import InvalidRequestError
from yutu.engine.sampler import Sampler, TokenHistory
from yutu.engine.sampling import SamplingParams
from yutu.engine.structured import GrammarFailed, Grammars, LRUCache, grammar_from, mask_rows_, unpack_bitmask
from yutu.engine.tokenizer import Tokenizer

from tests.engine.engine_support import make_engine, prompt
from tests.engine.test_engine_e2e import run, tokens

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["moon", "rabbit"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def bitmask_of(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """(R, W) int32 bitmasks allowing the given token ids per row."""
    bits = torch.zeros(len(allowed), (vocab + 31) // 32 * 32, dtype=torch.bool)
    for r, ids in enumerate(allowed):
        bits[r, ids] = True
    words = (bits.view(len(allowed), -1, 32).to(torch.int64) << torch.arange(32)).sum(-1)  # in [0, 2**32)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # the same bits, signed


def test_bitmask_round_trip() -> None:
    allowed = [[0, 1, 31, 32, 63, 99], [5], list(range(100))]
    mask = bitmask_of(allowed, 100)
    assert mask.dtype == torch.int32 and mask.shape == (3, 4)
    got = unpack_bitmask(mask, 100)
    assert [row.nonzero().squeeze(1).tolist() for row in got] == allowed


def test_mask_keeps_only_allowed_tokens_and_they_beat_every_other() -> None:
    lowest = torch.finfo(torch.float32).min
    scores = torch.tensor([[5.0, 1.0, 3.0, lowest], [0.0, 9.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    mask_rows_(scores, [0, 1], bitmask_of([[1, 3], [0, 2]], 4))
    assert scores[0, 1] == 1.0 and scores[0, 0] == scores[0, 2] == lowest
    assert lowest < scores[0, 3] < scores[0, 1]  # an allowed token at float32's lowest still wins
    assert scores[0].argmax() == 1 and scores[1].argmax() == 2
    assert scores[2].tolist() == [1.0, 2.0, 3.0, 4.0]  # a row without a grammar is untouched


@pytest.fixture(scope="module")
def kernels() -> object:
    from yutu.engine import native

    return native.load()


@pytest.mark.parametrize("vocab", [5, 32, 100, 2_560])
def test_native_mask_equals_the_torch_reference_bit_for_bit(kernels: object, vocab: int) -> None:
    """Rows near float32's bounds, bitmask words all set, all clear and mixed, a vocabulary that
    is not a multiple of 32, rows listed out of order and one left out."""
    info = torch.finfo(torch.float32)
    torch.manual_seed(vocab)
    scores = torch.randn(5, vocab) * 10
    scores[0, : min(vocab, 4)] = torch.tensor([info.min, info.max, -info.tiny, 0.0])[: min(vocab, 4)]
    scores[3] = info.min
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # every token allowed
    bitmask[2] = 0  # none
    rows = [4, 0, 1, 3]
    want, got = scores.clone(), scores.clone()
    mask_rows_(want, rows, bitmask)
    kernels.mask_rows_(got, torch.tensor(rows), bitmask)  # type: ignore[attr-defined]
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))
    assert torch.equal(got[2], scores[2])  # not listed: untouched
    assert bool((got[rows[2]] == info.min).all())  # bitmask[2]: nothing allowed
    assert bool((got > info.min).sum() > 0)


@pytest.mark.parametrize("native", [False, True])
def test_sampler_draws_only_allowed_tokens_on_both_paths(kernels: object, native: bool) -> None:
    """Greedy and random rows with a grammar, beside rows without one, with a bias and min_tokens
    held back: every token comes from its row's allowed set, and the rows without a grammar get
    what they would get alone. Logprobs stay the raw logits'."""
    vocab = 300
    torch.manual_seed(0)
    logits = torch.randn(6, vocab) * 3
    grammar = "(compiled elsewhere: the sampler only reads the bitmask)"
    allowed = [[7, 8, 250], [], [1, 2, 3, 299], [], [42], [10, 11]]
    params = [
        SamplingParams(temperature=0, grammar=grammar, logprobs=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, seed=3, grammar=grammar),
        SamplingParams(temperature=1.5, seed=4),
        # min_tokens holds 42 (an eos) back, but the grammar allows nothing else: the grammar wins
        SamplingParams(temperature=0, grammar=grammar, min_tokens=5, max_tokens=9, stop_token_ids=(42,)),
        SamplingParams(temperature=0.7, top_k=1, grammar=grammar, logit_bias=((10, -100.0),)),
    ]
    histories = [None, None, None, None, TokenHistory([1, 2], 2, (42,)), TokenHistory([1, 2], 2)]
    sampler = Sampler(kernels if native else None)
    for draw in range(20):
        gens = [None, None, torch.Generator().manual_seed(draw), torch.Generator().manual_seed(9), None, None]
        out = sampler.sample(logits, params, gens, histories, bitmask_of(allowed, vocab))
        for r in (0, 2, 4, 5):
            assert out.token_ids[r] in allowed[r], (draw, r)
        assert out.token_ids[0] == max(allowed[0], key=lambda t: logits[0, t])
        assert out.token_ids[4] == 42 and out.token_ids[5] == 11
        plain = sampler.sample(
            logits[[1, 3]], [params[1], params[3]], [None, torch.Generator().manual_seed(9)]
        )
        assert [out.token_ids[1], out.token_ids[3]] == plain.token_ids
    assert out.logprobs[0] is not None
    raw = torch.log_softmax(logits[0], -1)[out.token_ids[0]].item()
    assert out.logprobs[0].logprob == pytest.approx(raw, abs=1e-5)
    with pytest.raises(ValueError, match="bitmask"):
        sampler.sample(logits[:1], params[:1], [None])


@pytest.fixture(scope="module")
def tokenizer(ckpt: Path) -> Tokenizer:
    return Tokenizer.from_dir(ckpt)


CASES: dict[str, tuple[str, Any]] = {
    "schema": ("json_schema", PERSON),
    "regex": ("regex", r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]+){0,2}"),
    "choice": ("choice", ["jade rabbit", "moon", "mooncake festival"]),
    "lark": ("grammar", 'start: "(" num (" + " num)* ")"\nnum: /[1-9][0-9]?/'),
}


def follows(case: str, text: str) -> bool:
    kind, spec = CASES[case]
    if case == "schema":
        value = json.loads(text)
        return (
            set(value) == set(PERSON["properties"])
            and isinstance(value["name"], str) and len(value["name"]) <= 6
            and type(value["age"]) is int and 0 <= value["age"] <= 150
            and all(t in ("moon", "rabbit") for t in value["tags"]) and len(value["tags"]) <= 2
            and type(value["ok"]) is bool
        )  # fmt: skip
    if case == "regex":
        return re.fullmatch(spec, text) is not None
    if case == "choice":
        return text in spec
    return re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text) is not None


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_follow_their_grammar_and_end_when_it_does(
    ckpt: Path, tokenizer: Tokenizer, case: str
) -> None:
    """Greedy and sampled (temperature 2: the random model's flattest choices), in one batch with
    a request without a grammar: each constrained output parses and ends with stop once complete."""
    grammar = grammar_from(*CASES[case])
    requests = {
        "greedy": (prompt(20, seed=1), SamplingParams(temperature=0, max_tokens=120, grammar=grammar)),
        **{
            f"random{s}": (
                prompt(20, seed=2),
                SamplingParams(temperature=2.0, seed=s, max_tokens=120, grammar=grammar),
            )
            for s in range(4)
        },
        "free": (prompt(9, seed=3), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
    }
    outs = run(make_engine(ckpt), requests)
    texts = set()
    for rid in requests:
        if rid == "free":
            continue
        text = tokenizer.decode(tokens(outs[rid]))
        assert outs[rid][-1].finish_reason is FinishReason.STOP, (rid, text)
        assert follows(case, text), (rid, text)
        texts.add(text)
    assert len(texts) > 1  # sampling explores the grammar, not one fixed string
    alone = run(make_engine(ckpt), {"free": requests["free"]})
    assert tokens(outs["free"]) == tokens(alone["free"])


def test_greedy_under_a_schema_is_the_best_allowed_token_of_transformers_logits(ckpt: Path) -> None:
    """The reference: at every step, transformers' logits for the sequence so far, masked by a
    matcher built here from the tokenizer and the schema, give the engine's token as their argmax."""
    from transformers import AutoModelForCausalLM

    ids = prompt(30, seed=5)
    grammar = grammar_from("json_schema", PERSON)
    got = tokens(
        run(make_engine(ckpt), {"r": (ids, SamplingParams(temperature=0, max_tokens=80, grammar=grammar))})[
            "r"
        ]
    )
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    eos = hf.config.eos_token_id
    llt = llguidance.LLTokenizer((ckpt / "tokenizer.json").read_text(), n_vocab=hf.config.vocab_size,
                                 eos_token=eos if isinstance(eos, int) else list(eos))  # fmt: skip
    matcher = llguidance.LLMatcher(llt, grammar)
    assert len(got) > 10
    seq = list(ids)
    for token in got:
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1]
        allowed = torch.tensor(list(matcher.compute_logit_bias())) > 0
        want = int(torch.where(allowed, logits, float("-inf")).argmax())
        assert token == want
        assert matcher.consume_token(token)
        seq.append(token)
    assert matcher.is_stopped()


def test_a_continuation_replays_the_tokens_generated_elsewhere(ckpt: Path) -> None:
    """A decode instance (or a migration) adds the request with the tokens generated so far: its
    matcher is rebuilt from them and the output goes on as in one run; tokens the grammar refuses
    are an invalid request."""
    ids = prompt(25, seed=6)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=100, grammar=grammar_from(*CASES["schema"]))
    whole = tokens(run(make_engine(ckpt), {"r": (ids, params)})["r"])
    assert len(whole) > 6
    engine = make_engine(ckpt)
    engine.add_request("r", ids, params, generated=whole[:5])
    outputs: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs += out.new_token_ids
    assert whole[:5] + outputs == whole
    # the grammar is compiled now: refused at once; on a fresh engine, once compiled, by the step
    with pytest.raises(InvalidRequestError, match="does not follow the request's grammar"):
        engine.add_request("bad", ids, params, generated=[whole[1]])  # a JSON object starts with "{"
    assert not engine.has_unfinished_requests()
    fresh = make_engine(ckpt)
    fresh.add_request("bad", ids, params, generated=[whole[1]])
    refused = [out for out in fresh.step()]
    while not refused and fresh.has_unfinished_requests():
        refused = fresh.step()
    assert [out.request_id for out in refused] == ["bad"] and refused[0].refused
    assert "does not follow the request's grammar" in (refused[0].error or "")
    assert not fresh.has_unfinished_requests() and fresh.block_manager.num_used_blocks == 0


def test_a_checkpoint_without_a_tokenizer_refuses_grammars_only(tmp_path: Path, ckpt: Path) -> None:
    with pytest.raises(InvalidRequestError, match="tokenizer.json"):
        Grammars(tmp_path, 512, [1]).matcher(grammar_from("regex", "a"))
    with pytest.raises(InvalidRequestError, match="eos token"):
        Grammars(ckpt, 512, []).matcher(grammar_from("regex", "a"))
    with pytest.raises(InvalidRequestError, match="cannot use this model's tokenizer"):
        Grammars(ckpt, 100, [1]).matcher(grammar_from("regex", "a"))  # a vocabulary smaller than it


def test_a_grammar_that_does_not_compile_is_an_invalid_request(ckpt: Path) -> None:
    """Found by the compile (off the step): a refused output, not the engine's failure; the engine
    steps on."""
    engine = make_engine(ckpt)
    engine.add_request(
        "r", prompt(5, seed=7), SamplingParams(grammar='{"grammars": [{"lark_grammar": "x"}]}')
    )
    engine.add_request(
        "free", prompt(6, seed=7), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    outs = run_on(engine)
    assert len(outs["r"]) == 1 and outs["r"][0].refused and outs["r"][0].failed
    assert "the request's grammar does not compile" in (outs["r"][0].error or "")
    assert len(tokens(outs["free"])) == 4 and engine.consecutive_failed_steps == 0
    for kind, spec, problem in [
        ("json_schema", {"type": "objectx"}, "objectx"),
        ("json_schema", "{not json", "not valid JSON"),
        ("regex", "((", "unclosed group"),
        ("choice", [], "non-empty list"),
        ("grammar", "start: undefined_rule", "undefined_rule"),
    ]:
        with pytest.raises(ValueError, match=problem):
            grammar_from(kind, spec)  # type: ignore[arg-type]


def test_a_grammar_that_fails_fails_its_request_alone(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control paths the mask never takes on its own: a matcher that errs while computing its mask,
    and a mask that let through a token the grammar refuses (here tampered with to allow all).
    Each fails its own request with the reason; the request beside them runs on."""
    engine = make_engine(ckpt)
    letters = SamplingParams(temperature=0, max_tokens=30, grammar=grammar_from("regex", "[a-z]{25,30}"))
    engine.grammars.matcher(letters.grammar or "")  # compiled here: the requests are admitted at once
    engine.add_request("errs", prompt(10, seed=8), letters)
    engine.add_request("leaks", prompt(11, seed=9), letters)
    engine.add_request(
        "free", prompt(12, seed=10), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )

    def errs(row: torch.Tensor) -> None:
        raise GrammarFailed("the request's grammar failed: a limit")

    def leaks(row: torch.Tensor) -> None:
        row.fill_(-1)

    monkeypatch.setattr(engine._seqs["errs"].grammar, "fill_bitmask", errs)
    monkeypatch.setattr(engine._seqs["leaks"].grammar, "fill_bitmask", leaks)
    outs: dict[str, list[Any]] = {"errs": [], "leaks": [], "free": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    assert outs["errs"][-1].finish_reason is FinishReason.ABORT and "a limit" in (
        outs["errs"][-1].error or ""
    )
    assert outs["errs"][-1].refused  # the grammar's fault, not the engine's
    assert outs["leaks"][-1].finish_reason is FinishReason.ABORT and not outs["leaks"][-1].refused
    assert "broke the request's grammar" in (outs["leaks"][-1].error or "")
    assert len(tokens(outs["free"])) == 8 and outs["free"][-1].finish_reason is FinishReason.LENGTH
    assert engine.block_manager.num_used_blocks == 0


def run_on(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step ``engine`` until it has nothing left; its outputs by request."""
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert engine.block_manager.num_used_blocks == 0
    return outs


@pytest.fixture
def held_compiles(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Grammar compiles wait on the compiling thread until the returned event is set."""
    gate = threading.Event()
    real = structured._compile

    def held(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
        assert gate.wait(30), "the test never let the compile go on"
        return real(tokenizer, grammar)

    monkeypatch.setattr(structured, "_compile", held)
    return gate


def test_requests_step_on_while_a_grammar_compiles_and_it_then_runs_as_if_compiled_before(
    ckpt: Path, held_compiles: threading.Event
) -> None:
    """The compile happens off the step: a running request keeps getting tokens while a new
    request's grammar compiles, and the constrained output is then the one of an engine that had
    the grammar compiled on its own thread first (the plain path)."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, grammar=grammar_from(*CASES["schema"]))
    free = (prompt(9, seed=3), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine = make_engine(ckpt)
    engine.add_request("free", *free)
    engine.add_request("json", prompt(20, seed=12), params)
    engine.add_request("json2", prompt(21, seed=13), params)  # the same grammar: one compile
    assert engine.stats().num_waiting == 3 and engine.has_unfinished_requests()
    early = [out for _ in range(5) for out in engine.step()]
    assert [out.request_id for out in early] == ["free"] * 5  # none of json's until its grammar is in
    assert engine.stats().num_waiting == 2
    held_compiles.set()
    outs = run_on(engine)
    reference = make_engine(ckpt)
    reference.grammars.matcher(params.grammar or "")
    want = run(reference, {"json": (prompt(20, seed=12), params), "json2": (prompt(21, seed=13), params)})
    assert tokens(outs["json"]) == tokens(want["json"]) and tokens(outs["json2"]) == tokens(want["json2"])
    assert outs["json"][-1].finish_reason is FinishReason.STOP
    assert tokens(early) + tokens(outs["free"]) == tokens(run(make_engine(ckpt), {"free": free})["free"])


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(
    ckpt: Path, tokenizer: Tokenizer, held_compiles: threading.Event
) -> None:
    engine = make_engine(ckpt)
    params = SamplingParams(temperature=0, max_tokens=20, grammar=grammar_from("regex", "[a-z]{5,9}"))
    engine.add_request("a", prompt(8, seed=14), params)
    engine.add_request("b", prompt(9, seed=15), params)
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request("a", prompt(8, seed=14), params)
    engine.abort_request("a")
    assert engine.abort_all() == ["b"]
    assert not engine.has_unfinished_requests() and engine.stats().num_waiting == 0
    held_compiles.set()
    assert engine.step() == [] and engine.block_manager.num_used_blocks == 0
    engine.add_request("a", prompt(8, seed=14), params)  # its id is free again, the compile done
    assert re.fullmatch("[a-z]{5,9}", tokenizer.decode(tokens(run_on(engine)["a"])))


def test_a_grammar_beyond_the_parsers_limits_refuses_its_request_with_the_reason(ckpt: Path) -> None:
    """An object of 600 optional properties compiles, and its mask allows an opening key, but
    taking it puts more items in the parser's row than llguidance allows (2,000): the request is
    refused (its grammar's fault, not the engine's) with the parser's reason; the request beside it
    runs on."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    engine = make_engine(ckpt)
    engine.add_request(
        "wide",
        prompt(10, seed=16),
        SamplingParams(temperature=0, max_tokens=20, grammar=grammar_from("json_schema", wide)),
    )
    engine.add_request(
        "free", prompt(11, seed=17), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    outs = run_on(engine)
    (refused,) = outs["wide"]
    assert refused.refused and refused.finish_reason is FinishReason.ABORT
    assert "the request's grammar failed" in (refused.error or "") and "max is 2000" in (refused.error or "")
    assert "\n" not in (refused.error or "")  # the reason's first line, not the parser's state
    assert len(tokens(outs["free"])) == 6 and engine.stats().failed_requests_total == 0


def test_json_whitespace_compact_or_as_the_pattern_allows(ckpt: Path, tokenizer: Tokenizer) -> None:
    """JSON output is compact by default -- ", " and ": " between items, no other whitespace (vLLM's
    xgrammar without any_whitespace) --; a whitespace pattern (vLLM's whitespace_pattern) allows
    that whitespace, optionally, between JSON tokens after "," and ":" alone; other kinds take none."""
    view = llguidance.LLTokenizer(
        (ckpt / "tokenizer.json").read_text(encoding="utf-8"), n_vocab=tokenizer.vocab_size,
        eos_token=list(tokenizer.eos_token_ids),
    )  # fmt: skip
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
              "required": ["a", "b"]}  # fmt: skip

    def accepts(whitespace: str | None, text: str) -> bool:
        matcher = llguidance.LLMatcher(view, grammar_from("json_schema", schema, whitespace), log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    texts = [
        '{"a": 1, "b": [1, 2]}',
        '{"a":1,"b":[1,2]}',
        '{\n"a":\n1,\n"b":\n[1,\n2]\n}',
        '{ "a" : 1 , "b" : [ 1 ] }',
    ]
    assert [accepts(None, t) for t in texts] == [True, False, False, False]
    assert [accepts(structured.ANY_WHITESPACE, t) for t in texts] == [True, True, True, True]
    assert [accepts(r"\n", t) for t in texts] == [False, True, True, False]
    with pytest.raises(ValueError, match="JSON output"):
        grammar_from("regex", "[a-z]+", r"\n")
    with pytest.raises(ValueError, match="unclosed"):
        grammar_from("json_schema", schema, "[(")


def test_the_lru_cache_keeps_the_recent_within_its_count_and_its_bytes() -> None:
    cache: LRUCache[str, str] = LRUCache(3, 10, lambda key, value: len(value))
    for key, value in [("a", "xx"), ("b", "xxx"), ("c", "x")]:
        cache.put(key, value)
    assert cache.get("a") == "xx" and cache.bytes == 6  # now the most recent
    cache.put("d", "xx")  # a fourth: the least recently used goes (b, not a)
    assert "b" not in cache and list(map(cache.get, "acd")) == ["xx", "x", "xx"] and cache.bytes == 5
    cache.put("e", "xxxxxxx")  # 12 bytes: a (the least recently read) goes, 10 fit
    assert "a" not in cache and len(cache) == 3 and cache.bytes == 10
    cache.put("f", "x" * 50)  # over the bound alone: kept, the rest go
    assert len(cache) == 1 and cache.get("f") and cache.bytes == 50
    cache.put("f", "y")  # put again: its cost replaced, not added
    assert cache.bytes == 1 and cache.get("f") == "y" and cache.get("zz") is None


def test_an_engine_caches_grammars_within_its_bytes(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each grammar's matcher takes ~50-70x its text in memory: the cache holds at most
    GRAMMAR_CACHE_BYTES of grammar text, dropping the least recently used."""
    grammars = [grammar_from("regex", f"{'a' * n}[0-9]+") for n in (1, 2, 3)]
    monkeypatch.setattr(structured, "GRAMMAR_CACHE_BYTES", len(grammars[1]) + len(grammars[2]))
    cache = Grammars(ckpt, 512, [1])
    for grammar in grammars:
        cache.matcher(grammar)
    assert [cache.is_compiled(g) for g in grammars] == [False, True, True]


START, END = 2, 3  # any two tokens serve as a reasoning model's markers here


def allowed_ids(grammar: structured.Grammar, vocab: int = 512) -> set[int]:
    """The tokens ``grammar``'s mask allows next."""
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(row)
    return set(unpack_bitmask(row[None], vocab)[0].nonzero().squeeze(1).tolist())


def test_a_grammar_after_thinking_holds_from_the_end_marker(ckpt: Path, tokenizer: Tokenizer) -> None:
    """(start, end, opened): the first token may be the grammar's or ``start``; while thinking
    every token may come and the grammar waits; after ``end`` it holds as from its beginning."""
    grammars = Grammars(ckpt, 512, [1])
    spec = grammar_from("json_schema", PERSON)
    fresh = allowed_ids(grammars.matcher(spec))
    assert START not in fresh and END not in fresh and len(fresh) < 100
    gated = grammars.matcher(spec, after_thinking=(START, END, False))
    assert allowed_ids(gated) == fresh | {START}  # undecided: the grammar's first tokens, or start
    gated.advance(START)
    assert allowed_ids(gated) == set(range(512)) and not gated.is_done  # thinking: anything
    for token in (START, 7, 200, 1):  # thinking takes any token, the start marker again too
        gated.advance(token)
    gated.advance(END)
    assert allowed_ids(gated) == fresh  # the grammar, from its beginning
    with pytest.raises(InvalidRequestError, match="does not follow"):
        gated.advance(START)
    straight = grammars.matcher(spec, after_thinking=(START, END, False))
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    straight.advance(brace)  # no thinking: the grammar took the first token
    assert START not in allowed_ids(straight)
    opened = grammars.matcher(spec, after_thinking=(START, END, True))
    assert allowed_ids(opened) == set(range(512))  # the prompt opened the thinking
    opened.advance(END)
    assert allowed_ids(opened) == fresh


def test_the_engine_defers_a_grammar_while_the_model_thinks(ckpt: Path, tokenizer: Tokenizer) -> None:
    """A bias the grammar alone would mask: with the gate, a thinking model takes it (the start
    marker first, then thinking until max_tokens); a prompt that opened the thinking and an end
    marker sampled first: the grammar's answer follows and ends the request; and a decode
    instance's replay of thinking tokens goes on under the grammar."""
    choice = grammar_from("choice", ["yes", "no"])
    ids = prompt(12, seed=8)

    def params(bias: int, opened: bool, gate: bool = True) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=6, grammar=choice, logit_bias=((bias, 100.0),),
                              grammar_after_thinking=(START, END, opened) if gate else None)  # fmt: skip

    outs = run(make_engine(ckpt), {"think": (ids, params(START, False)), "plain": (ids, params(START, False, False)),
                                   "answer": (ids, params(END, True))})  # fmt: skip
    assert tokens(outs["think"]) == [START] * 6 and outs["think"][-1].finish_reason is FinishReason.LENGTH
    assert tokenizer.decode(tokens(outs["plain"])) in ("yes", "no")  # the grammar alone masks the bias
    answer = tokens(outs["answer"])
    assert answer[0] == END and tokenizer.decode(answer[1:]) in ("yes", "no")
    assert outs["answer"][-1].finish_reason is FinishReason.STOP
    engine = make_engine(ckpt)
    engine.add_request("r", ids, params(END, False), generated=[START, 77, 5, END])
    continued: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            continued += out.new_token_ids
    assert tokenizer.decode(continued) in ("yes", "no")
    with pytest.raises(InvalidRequestError, match="does not follow"):
        engine.add_request("bad", ids, params(END, False), generated=[77])  # no thinking: the grammar's
    with pytest.raises(InvalidRequestError, match="grammar_after_thinking token ids"):
        engine.add_request(
            "far", ids, replace(params(END, False), grammar_after_thinking=(START, 512, False))
        )


@pytest.mark.parametrize(
    ("gate", "grammar", "message"),
    [
        ((START, START, False), "x", "two distinct token ids"),
        ((START, END), "x", "two distinct token ids"),
        ((START, END, 1), "x", "two distinct token ids"),
        ((-1, END, False), "x", "two distinct token ids"),
        ((START, END, False), None, "give one"),
    ],
)
def test_grammar_after_thinking_is_checked(gate: Any, grammar: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(grammar=grammar, grammar_after_thinking=gate)
    if grammar is not None:
        assert SamplingParams(grammar="x", grammar_after_thinking=[2, 3, True]).grammar_after_thinking == (
            2,
            3,
            True,
        )
