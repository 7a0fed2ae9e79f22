"""``allowed_token_ids`` and ``bad_words`` on the tiny engine (CPU, float32): what greedy and seeded
generation make of them, and the ids the engine refuses. Reference: the engine's own greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
from yutu.engine.errors import InvalidRequestError
from yutu.engine.outputs import FinishReason
from yutu.engine.sampling import SamplingParams

from tests.engine.engine_support import VOCAB, make_engine, prompt
from tests.engine.test_engine_e2e import greedy, run, tokens


def contains(seq: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(seq[i : i + len(word)]) == word for i in range(len(seq) - len(word) + 1))


def test_allowed_token_ids_restrict_every_generated_token(ckpt: Path) -> None:
    """Greedy with allowed tokens is greedy over them alone, after its penalty (a bias of 100 on each
    of them, the tiny model's logits lying well within 100 of each other, picks the same); a seeded
    random request draws only among them; a request beside them without a mask is untouched; an
    eos ends a request only where it is allowed."""
    ids = prompt(20, seed=31)
    plain = tokens(run(make_engine(ckpt), {"r": (ids, greedy(12))})["r"])
    allowed = tuple(t for t in range(4, VOCAB, 23) if t not in plain)  # (22 ids) none of greedy's own
    random = SamplingParams(
        temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed
    )
    requests = {
        "plain": (ids, greedy(12)),
        "allowed": (ids, greedy(12, allowed_token_ids=allowed, frequency_penalty=1.0)),
        "biased": (ids, greedy(12, logit_bias=tuple((t, 100.0) for t in allowed), frequency_penalty=1.0)),
        "random": (ids, random),
    }
    got = {rid: tokens(outs) for rid, outs in run(make_engine(ckpt), requests).items()}
    assert got["plain"] == plain
    assert got["allowed"] == got["biased"] and len(got["allowed"]) == 12
    assert len(set(got["allowed"])) > 1  # the penalty moves it: more than one step is decided
    assert set(got["allowed"]) <= set(allowed) and set(got["random"]) <= set(allowed)
    assert len(got["random"]) == 12 and len(set(got["random"])) > 1  # it really samples
    eos = make_engine(ckpt).model_config.eos_token_ids[0]
    only_eos = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=(eos,))
    ended = run(make_engine(ckpt), {"r": (ids, only_eos)})["r"]
    assert tokens(ended) == [eos] and ended[-1].finish_reason is FinishReason.STOP


def first_new_word(plain: list[int], length: int) -> int:
    """The first position i where ``plain[i : i + length]`` does not occur earlier in ``plain``: as a
    bad word, it changes nothing before its last token, at ``i + length - 1``."""
    for i in range(len(plain) - length + 1):
        word = tuple(plain[i : i + length])
        if not contains(plain[: i + length - 1], word):
            return i
    raise AssertionError(f"greedy output {plain} has no new {length}-token word")


def test_a_bad_word_greedy_would_produce_is_never_produced(ckpt: Path) -> None:
    """Greedy output with one of its own 3-token stretches as a bad word: identical up to the word's
    last token, different there, and the word nowhere in it; a one-token bad word never appears; a
    word whose prefix is the prompt's last token bans nothing at the first step (the prompt does not
    count). The request beside it, without bad words, is untouched."""
    ids = prompt(30, seed=12)
    plain = tokens(run(make_engine(ckpt), {"r": (ids, greedy(16))})["r"])
    i = first_new_word(plain, 3)
    word = tuple(plain[i : i + 3])
    outs = run(
        make_engine(ckpt), {"plain": (ids, greedy(16)), "banned": (ids, greedy(16, bad_words=(word,)))}
    )
    banned = tokens(outs["banned"])
    assert tokens(outs["plain"]) == plain
    assert banned[: i + 2] == plain[: i + 2] and banned[i + 2] != plain[i + 2]
    assert not contains(banned, word) and len(banned) == 16

    one = tokens(run(make_engine(ckpt), {"r": (ids, greedy(16, bad_words=((plain[0],), (plain[3],))))})["r"])
    assert one[0] != plain[0] and plain[0] not in one and plain[3] not in one

    after_prompt = (ids[-1], plain[0])  # would ban plain[0] at once if the prompt counted
    assert not contains(plain, after_prompt)  # nor does the output hold it
    kept = tokens(run(make_engine(ckpt), {"r": (ids, greedy(16, bad_words=(after_prompt,)))})["r"])
    assert kept == plain


@pytest.mark.parametrize(
    ("field", "value"),
    [("allowed_token_ids", (3, VOCAB)), ("bad_words", ((3,), (4, VOCAB + 88)))],
)
def test_mask_ids_outside_the_vocabulary_are_refused(ckpt: Path, field: str, value: object) -> None:
    engine = make_engine(ckpt)
    with pytest.raises(InvalidRequestError, match=rf"{field} token ids must be integers in \[0, {VOCAB}\)"):
        engine.add_request("r", prompt(5, seed=1), greedy(4, **{field: value}))
    assert not engine.has_unfinished_requests()
