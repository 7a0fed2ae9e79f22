"""Sampler and SamplingParams: exact masks, greedy, seeds, logprobs, logit bias and penalties on
hand-made logits."""

from __future__ import annotations

import array
import math
from collections.abc import Sequence

import pytest
import torch
from yutu.engine.sampler import (
    TOP_CANDIDATES,
    Sampler,
    TokenHistory,
    adjust_logits,
    adjust_logits_native,
    apply_min_p,
    apply_top_k_top_p,
    banned_by_bad_words,
    draw_from,
    scale_by_temperature,
    top_k_top_p,
)
from yutu.engine.sampling import TOP_P_MIN, SamplingParams

NEG = float("-inf")


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_top_k_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.1, 0.5, 0.15, 0.25], [0.1, 0.5, 0.15, 0.25]]))
    top_k = torch.tensor([2, 4, 4])
    top_p = torch.tensor([1.0, 0.7, 0.45])
    out = apply_top_k_top_p(logits, top_k, top_p)
    kept = (out > NEG).tolist()
    assert kept[0] == [False, True, False, True]  # top-2: 0.5, 0.25
    assert kept[1] == [False, True, False, True]  # 0.5 + 0.25 reaches 0.7
    assert kept[2] == [False, True, False, False]  # the top token alone reaches 0.45
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])


def test_top_k_top_p_from_the_largest_values_masks_what_sorting_the_whole_row_masks() -> None:
    """Rows decided by their TOP_CANDIDATES largest values (top-k sets among them, top-p reached
    within them) and rows that are not (flat rows whose top_p mass spreads wider: the plain path),
    mixed in one batch: the same tokens kept, with the same logits, as the reference."""
    vocab = 8 * TOP_CANDIDATES
    gen = torch.Generator().manual_seed(3)
    peaked = torch.randn(6, vocab, generator=gen) * 4
    flat = torch.randn(3, vocab, generator=gen) * 0.1
    logits = torch.cat([peaked, flat])
    top_k = torch.tensor([vocab, 50, 1, TOP_CANDIDATES, vocab, 700, vocab, vocab, 2000])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.3, 0.95, 0.95, 0.5, 0.9])
    want = apply_top_k_top_p(logits, top_k, top_p)
    got = top_k_top_p(logits, top_k, top_p)
    assert torch.equal(got > NEG, want > NEG)
    assert torch.equal(got[got > NEG], want[want > NEG])
    kept = (want > NEG).sum(dim=1).tolist()
    assert kept[1] == 50 and kept[2] == 1 and kept[5] <= 700
    assert kept[6] > TOP_CANDIDATES and kept[7] > TOP_CANDIDATES  # the rows the plain path decided
    assert TOP_CANDIDATES < kept[8] < 2000  # candidates widened to its top-k set, top-p cut within
    # a vocabulary too small for candidates to pay: the plain version itself
    small = logits[:, :TOP_CANDIDATES]
    assert torch.equal(top_k_top_p(small, top_k.clamp(max=TOP_CANDIDATES), top_p),
                       apply_top_k_top_p(small, top_k.clamp(max=TOP_CANDIDATES), top_p))  # fmt: skip


def test_top_p_combined_with_top_k_renormalises() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top_k=3 leaves 0.4/0.9, 0.3/0.9, 0.2/0.9; top_p=0.7 then keeps the first two (0.44 + 0.33).
    out = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.7]))
    assert (out > NEG).tolist() == [[True, True, False, False]]


def test_greedy_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0)]
    out = Sampler().sample(logits, params, [None, None])
    assert out.token_ids == [1, 0]
    assert out.logprobs[1] is None
    lp = out.logprobs[0]
    assert lp is not None
    expected = torch.log_softmax(logits[0], dim=-1).tolist()
    assert lp.token_id == 1
    assert lp.logprob == pytest.approx(expected[1])
    assert [t for t, _ in lp.top] == [1, 3]
    assert [v for _, v in lp.top] == pytest.approx([expected[1], expected[3]])


def test_logprobs_use_raw_logits_not_temperature() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = Sampler().sample(logits, [SamplingParams(temperature=0.5, top_k=1, logprobs=0)], [None])
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 1 and lp.top == []
    assert lp.logprob == pytest.approx(2.0 - math.log(1 + math.exp(2.0) + math.exp(1.0)))


def test_top_k_one_and_tiny_top_p_are_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(top_k=1)] * 3 + [SamplingParams(top_p=1e-6)] * 3
    out = Sampler().sample(logits, params, [None] * 6)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_masks_what_its_formula_masks() -> None:
    """apply_min_p against the formula, element by element: a token stays iff its probability is
    at least min_p times its row's largest (vLLM's MinPLogitsProcessor); min_p 0 keeps every
    token, 1 only the most likely."""
    torch.manual_seed(3)
    logits = torch.randn(5, 300) * 3
    min_p = torch.tensor([0.0, 0.05, 0.3, 0.9, 1.0])
    out = apply_min_p(logits, min_p)
    for r in range(5):
        top = max(logits[r].tolist())
        for v, x in enumerate(logits[r].tolist()):
            ratio, kept = math.exp(x - top), out[r, v].item() != NEG  # its probability over the top one's
            if abs(ratio - float(min_p[r])) > 1e-5:  # clear of float32's rounding at the bound
                assert kept == (ratio >= float(min_p[r])), (r, v, ratio)
            assert not kept or out[r, v] == logits[r, v]
    assert (
        (out[0] == logits[0]).all() and (out[4] != NEG).sum() == 1 and out[4].argmax() == logits[4].argmax()
    )


def test_samples_stay_above_min_p_and_min_p_one_is_argmax() -> None:
    """After temperature (vLLM's order): at temperature 1 the tokens of probability >= half the
    top one's are drawn, the others never; min_p 1 draws the argmax at any temperature."""
    torch.manual_seed(0)
    logits = torch.zeros(256, 10)
    logits[:, 7], logits[:, 2], logits[:, 5] = 3.0, 2.5, 1.0  # 2 is e**-0.5 = 0.61 of 7; 5 is 0.14
    out = Sampler().sample(logits, [SamplingParams(temperature=1.0, min_p=0.5)] * 256, [None] * 256)
    assert set(out.token_ids) == {7, 2}
    mixed = [SamplingParams(temperature=2.0, min_p=1.0, seed=s) for s in range(8)] + [
        SamplingParams(temperature=2.0)
    ] * 8
    rows = torch.randn(16, 50)
    got = Sampler().sample(rows, mixed, [gen(s) for s in range(8)] + [None] * 8).token_ids
    assert got[:8] == rows[:8].argmax(dim=-1).tolist()


def test_samples_stay_inside_top_k() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(64, 10)
    logits[:, 7], logits[:, 2], logits[:, 5] = 3.0, 2.9, 2.8
    out = Sampler().sample(logits, [SamplingParams(temperature=2.0, top_k=3)] * 64, [None] * 64)
    assert set(out.token_ids) == {7, 2, 5}


def test_seeded_row_ignores_batch_composition() -> None:
    torch.manual_seed(1)
    vocab = 512
    target = torch.randn(1, vocab)
    params = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_rows: int, position: int, n: int = 8) -> list[int]:
        g = gen(1234)
        tokens = []
        for _ in range(n):
            logits = torch.randn(batch_rows, vocab)
            logits[position] = target[0]
            row_params = [SamplingParams(temperature=0.8, seed=7)] * batch_rows
            row_params[position] = params
            gens: list[torch.Generator | None] = [None] * batch_rows
            gens[position] = g
            tokens.append(Sampler().sample(logits, row_params, gens).token_ids[position])
        return tokens

    alone = draws(1, 0)
    assert draws(5, 3) == alone
    assert draws(3, 0) == alone
    assert len(set(alone)) > 1  # it really samples


def test_draw_from_picks_the_first_token_whose_cumulative_probability_exceeds_the_uniform() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])

    def plain(row: list[float], u: float) -> int:
        total, running = sum(row), 0.0
        for token, p in enumerate(row):
            running += p
            if running > u * total:
                return token
        raise AssertionError("no token")

    for u in [0.0, 0.1, 0.25, 0.2500001, 0.5, 0.74, 0.75, 0.99, 1.0 - 2**-24]:
        got = draw_from(probs, torch.tensor([u, u])).tolist()
        assert got == [plain(row, u) for row in probs.tolist()]
        assert got[0] in (1, 3, 4) and got[1] == 5  # never a token of probability 0


def test_draws_follow_the_distribution() -> None:
    """20,000 draws of one row: each token's share within 4 standard deviations of its probability
    (the distribution the reference torch.multinomial draws from), zero-probability tokens never."""
    probs = torch.tensor([0.5, 0.2, 0.0, 0.15, 0.1, 0.05, 0.0])
    n = 20_000
    tokens = draw_from(probs.expand(n, -1), torch.rand(n, generator=gen(7)))
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    sd = (n * probs.double() * (1 - probs.double())).sqrt()
    assert ((counts - n * probs.double()).abs() <= 4 * sd).all(), counts.tolist()
    assert counts[2] == counts[6] == 0


def test_rows_without_top_k_or_top_p_skip_the_sort_and_draw_what_masking_every_row_draws(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only restricted rows go through apply_top_k_top_p (a vocabulary-wide sort per row); an
    unrestricted row would come out of it unchanged, so every seeded draw equals the plain
    version's (each row masked, softmaxed and drawn from its own generator), in batches of free
    rows only, restricted rows only, and both."""
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(6, vocab) * 3
    free = SamplingParams(temperature=0.8, seed=1)
    rows = [free, SamplingParams(temperature=1.3, top_k=20, seed=2), SamplingParams(top_p=0.9, seed=3)]
    batches = [[free, free], rows[1:], rows + rows[::-1]]

    def plain(params: list[SamplingParams]) -> list[list[int]]:
        gens = [gen(p.seed or 0) for p in params]
        steps = []
        for _ in range(8):
            step = []
            for r, p in enumerate(params):
                scaled = scale_by_temperature(logits[r : r + 1], torch.tensor([p.temperature]))
                top_k = torch.tensor([min(p.top_k or vocab, vocab)])
                probs = apply_top_k_top_p(scaled, top_k, torch.tensor([p.top_p])).softmax(dim=-1)
                step.append(int(draw_from(probs, torch.rand(1, generator=gens[r]))[0]))
            steps.append(step)
        return steps

    expected = [plain(b) for b in batches]
    masked_rows: list[int] = []
    reference = apply_top_k_top_p

    def counting(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        masked_rows.append(scaled.shape[0])
        return reference(scaled, top_k, top_p)

    monkeypatch.setattr("yutu.engine.sampler.apply_top_k_top_p", counting)
    for params, want in zip(batches, expected, strict=True):
        gens = [gen(p.seed or 0) for p in params]
        got = [Sampler().sample(logits[: len(params)], params, gens).token_ids for _ in range(8)]
        assert got == want
    assert masked_rows == [2] * 8 + [4] * 8  # the free rows never reached the masks


def test_same_seed_repeats_different_seed_differs() -> None:
    logits = torch.zeros(1, 512)  # uniform: maximal entropy

    def stream(seed: int) -> list[int]:
        g = gen(seed)
        return [Sampler().sample(logits, [SamplingParams(seed=seed)], [g]).token_ids[0] for _ in range(8)]

    assert stream(1) == stream(1)
    assert stream(1) != stream(2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, r"temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, r"top_k must be an integer >= 1, or None"),
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1"),
        ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
        ({"logprobs": -1}, r"logprobs must be an integer in \[0, 20\]"),
        ({"seed": 2**64}, r"seed must be an integer in"),
        ({"stop_token_ids": (1, -2)}, r"stop_token_ids must be a sequence of integers >= 0"),
        ({"stop_token_ids": (2**63,)}, r"stop_token_ids must be a sequence of integers >= 0 \(at most"),
        ({"ignore_eos": 1}, r"ignore_eos must be a bool"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": float("nan")}, r"frequency_penalty must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": "1"}, r"frequency_penalty must be a number in"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": 1e-50}, r"repetition_penalty must be a finite number > 0 that float32 holds"),
        ({"repetition_penalty": float("inf")}, r"repetition_penalty must be a finite number > 0"),
        ({"logit_bias": ((1, 101),)}, r"logit_bias values must be in \[-100.0, 100.0\]"),
        ({"logit_bias": ((-1, 1),)}, r"logit_bias token ids must be integers >= 0"),
        ({"logit_bias": ((True, 1),)}, r"logit_bias token ids must be integers >= 0"),
        ({"logit_bias": ((1, 1), (1, 2))}, r"logit_bias names a token id more than once"),
        ({"logit_bias": (1, 2)}, r"logit_bias must be \(token id, bias\) pairs"),
        ({"min_tokens": 17}, r"min_tokens must be an integer in \[0, max_tokens=16\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_p": float("nan")}, r"min_p must be in \[0, 1\]"),
        ({"min_p": "0.1"}, r"min_p must be a number in"),
        ({"min_tokens": -1}, r"min_tokens must be an integer in"),
        ({"allowed_token_ids": ()}, r"allowed_token_ids must be a non-empty sequence of token ids"),
        ({"allowed_token_ids": [3, -1]}, r"allowed_token_ids must be a non-empty sequence of token ids"),
        ({"allowed_token_ids": (2**63,)}, r"allowed_token_ids must be .* at most 9223372036854775807"),
        ({"allowed_token_ids": (True,)}, r"allowed_token_ids must be a non-empty sequence"),
        ({"allowed_token_ids": 5}, r"allowed_token_ids must be a non-empty sequence"),
        ({"allowed_token_ids": (4, 2, 4)}, r"allowed_token_ids names a token id more than once"),
        ({"bad_words": ((),)}, r"bad_words must be a sequence of non-empty token-id sequences"),
        ({"bad_words": ((1, -2),)}, r"bad_words must be a sequence of non-empty token-id sequences"),
        ({"bad_words": ((1, 2**63),)}, r"bad_words must be .* at most 9223372036854775807"),
        ({"bad_words": (1, 2)}, r"bad_words must be a sequence of non-empty token-id sequences"),
        ({"bad_words": ("ab",)}, r"bad_words must be a sequence of non-empty token-id sequences"),
        ({"bad_words": [[1.0]]}, r"bad_words must be a sequence of non-empty token-id sequences"),
        # What the sampler computes in float32 / int64:
        (
            {"top_p": 1e-50},
            r"top_p must be >= 1\.401298464324817e-45 \(2\*\*-149, the smallest positive float32",
        ),
        ({"top_p": 1e-45}, r"top_p must be >= 1\.401298464324817e-45"),
        ({"top_p": 5e-324}, r"top_p must be >= 1\.401298464324817e-45"),
        ({"temperature": 1e39}, r"temperature=1e\+39 overflows float32"),
        ({"temperature": 10**400}, r"temperature must be a number >= 0, got an integer too large"),
        ({"top_p": 10**400}, r"top_p must be a number in \(0, 1\], got an integer too large"),
        (
            {"top_k": 2**63},
            r"top_k must be an integer >= 1, or None to disable it \(at most 9223372036854775807",
        ),
    ],
)
def test_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_params_defaults_and_normalisation() -> None:
    p = SamplingParams(stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert p.stop_token_ids == (3, 4)
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy
    assert SamplingParams(logprobs=20).logprobs == 20
    assert not SamplingParams().adjusts_logits
    biased = SamplingParams(logit_bias=[[5, 1], [2, -3.5]], frequency_penalty=1)  # type: ignore[arg-type]
    assert biased.logit_bias == ((5, 1.0), (2, -3.5)) and type(biased.frequency_penalty) is float
    assert biased.adjusts_logits
    assert SamplingParams(logit_bias={7: 2}).logit_bias == ((7, 2.0),)  # type: ignore[arg-type]
    for adjusting in ({"repetition_penalty": 1.1}, {"presence_penalty": -0.5}, {"logit_bias": ((0, 0.0),)}):
        assert SamplingParams(**adjusting).adjusts_logits  # type: ignore[arg-type]
    # msgpack hands lists over: normalised to tuples; either mask alone adjusts the logits
    masked = SamplingParams(allowed_token_ids=[7, 3], bad_words=[[5], [1, 2, 3]])  # type: ignore[arg-type]
    assert masked.allowed_token_ids == (7, 3) and masked.bad_words == ((5,), (1, 2, 3))
    assert SamplingParams(allowed_token_ids=[0]).adjusts_logits  # type: ignore[arg-type]
    assert SamplingParams(bad_words=[[9]]).adjusts_logits  # type: ignore[arg-type]
    assert SamplingParams().allowed_token_ids is None and SamplingParams().bad_words == ()


def test_smallest_top_p_and_huge_top_k_are_accepted() -> None:
    assert SamplingParams(top_p=TOP_P_MIN).top_p == 2.0**-149
    assert SamplingParams(top_p=1e-40).top_p == 1e-40  # a float32 subnormal
    assert SamplingParams(top_k=2**63 - 1).top_k == 2**63 - 1


def test_tiny_top_p_keeps_the_top_token_even_when_it_rounds_to_zero() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25]] * 3))
    # 2**-149 is float32's smallest subnormal; 0.0 stands for a top_p flushed to zero by the device.
    top_p = torch.tensor([2.0**-149, 1e-40, 0.0])
    kept = (apply_top_k_top_p(logits, torch.tensor([4, 4, 4]), top_p) > NEG).tolist()
    assert kept == [[False, True, False, False]] * 3


def test_subnormal_top_p_and_huge_top_k_sample_the_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(top_p=TOP_P_MIN), SamplingParams(top_p=1e-40, top_k=2**63 - 1)] * 2
    out = Sampler().sample(logits, params, [None, None, gen(1), gen(2)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_temperature_division_cannot_overflow() -> None:
    logits = torch.full((3, 6), -3e38)
    logits[0, 4] = 3e38  # 3e38 / 1e-5 overflows to inf
    logits[1, 2] = -1e38  # every scaled value overflows to -inf
    logits[2] = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])  # an ordinary row
    temps = torch.tensor([1e-5, 1e-5, 0.5])
    scaled = scale_by_temperature(logits, temps)
    assert scaled[0, 4] == 0 and scaled[1, 2] == 0  # shifted rows: the maximum scores exactly 0
    assert torch.equal(scaled[2], logits[2] / 0.5)  # untouched rows are exactly logits / temperature
    params = [SamplingParams(temperature=1e-5, logprobs=1)] * 2 + [SamplingParams(temperature=0.5)]
    out = Sampler().sample(logits, params, [gen(0), None, None])
    assert out.token_ids[:2] == [4, 2]
    lp = out.logprobs[0]
    assert lp is not None and lp.logprob == 0.0
    assert lp.top == [(4, 0.0)] and math.isfinite(lp.logprob)


def test_logprobs_are_always_finite() -> None:
    logits = torch.tensor([[3e38, -3e38, 0.0]])  # log_softmax of the middle token is -inf in float32
    out = Sampler().sample(logits, [SamplingParams(temperature=0, logprobs=3)], [None])
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 0
    assert [t for t, _ in lp.top] == [0, 2, 1]
    assert all(math.isfinite(v) for _, v in lp.top) and lp.top[2][1] == torch.finfo(torch.float32).min


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_rows_get_no_token_and_spare_the_others(bad: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 32)
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(seed=5, logprobs=1),
        SamplingParams(temperature=0.7),
        SamplingParams(seed=9),
    ]
    clean = Sampler().sample(logits, params, [None, gen(5), None, gen(9)])
    poisoned = logits.clone()
    poisoned[1, 3] = bad
    poisoned[2, 0] = bad
    torch.manual_seed(0)
    out = Sampler().sample(poisoned, params, [None, gen(5), None, gen(9)])
    assert out.nonfinite_rows == [1, 2]
    assert out.token_ids[1] is None and out.token_ids[2] is None and out.logprobs[1] is None
    assert out.token_ids[0] == clean.token_ids[0] and out.logprobs[0] == clean.logprobs[0]
    assert out.token_ids[3] == clean.token_ids[3]  # a seeded row draws from its own stream only
    assert clean.nonfinite_rows == []


# -- the native kernel's greedy rows (yutu.engine.native's greedy_rows), held to torch's operations --


@pytest.fixture(scope="module")
def kernels() -> object:
    from yutu.engine import native

    return native.load()  # built by `make test` before the tests


def awkward_rows(vocab: int) -> torch.Tensor:
    """Nine rows of ``vocab`` logits in bfloat16's steps (ties): random, rounded to integers (many
    tied at the maximum), all zero, the maximum in the last position, and three that are not finite."""
    g = gen(vocab)
    logits = (torch.randn(9, vocab, generator=g) * 4).to(torch.bfloat16).float()
    logits[3] = logits[3].round()
    logits[4] = 0.0
    logits[5, -1] = logits[5].max() + 1.0
    logits[6, vocab // 2] = float("nan")
    logits[7, 0] = float("inf")
    logits[8, -1] = float("-inf")
    return logits


@pytest.mark.parametrize("vocab", [1, 7, 64, 65, 1000, 8192])
def test_greedy_rows_match_torchs_argmax_and_log_softmax(kernels: object, vocab: int) -> None:
    logits = awkward_rows(vocab)
    token, top, log_sum, finite = kernels.greedy_rows(logits, True)  # type: ignore[attr-defined]
    want_finite = logits.isfinite().all(dim=-1)
    assert finite.tolist() == want_finite.tolist()
    clean = torch.where(want_finite.unsqueeze(1), logits, 0.0)  # what the sampler computes on
    assert token.tolist() == clean.argmax(dim=-1).tolist()  # the first maximum, as torch picks it
    assert torch.equal(top, clean.amax(dim=-1))
    logp = (clean - top.unsqueeze(1)) - log_sum.unsqueeze(1)
    assert (logp - torch.log_softmax(clean, dim=-1)).abs().max().item() <= 1e-5
    token_only, _, no_sums, _ = kernels.greedy_rows(logits, False)  # type: ignore[attr-defined]
    assert torch.equal(token_only, token) and no_sums.numel() == 0


def test_greedy_rows_read_rows_of_a_wider_buffer(kernels: object) -> None:
    wide = torch.randn(5, 300, generator=gen(2))
    token, top, _, _ = kernels.greedy_rows(wide[:, :257], False)  # type: ignore[attr-defined]
    assert token.tolist() == wide[:, :257].argmax(dim=-1).tolist()
    assert torch.equal(top, wide[:, :257].amax(dim=-1))


def test_greedy_rows_refuse_what_they_cannot_read(kernels: object) -> None:
    with pytest.raises(RuntimeError, match="float32"):
        kernels.greedy_rows(torch.zeros(2, 8, dtype=torch.bfloat16), False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="unit stride"):
        kernels.greedy_rows(torch.zeros(8, 2).t(), False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"\(R, V\)"):
        kernels.greedy_rows(torch.zeros(8), False)  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [None, float("nan"), float("-inf")])
def test_the_sampler_on_the_kernel_samples_what_it_samples_on_torchs_operations(kernels: object,
                                                                                bad: float | None) -> None:  # fmt: skip
    logits = (torch.randn(7, 700, generator=gen(3)) * 3).to(torch.bfloat16)  # as a bfloat16 model's
    if bad is not None:
        logits[2, 5] = bad
    params = [
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, seed=11, logprobs=0),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.2, top_k=20, seed=12),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.5, top_p=0.9, seed=13, logprobs=2),
    ]

    def generators() -> list[torch.Generator | None]:
        return [None, None, gen(11), None, gen(12), None, gen(13)]

    want = Sampler().sample(logits, params, generators())
    got = Sampler(kernels).sample(logits, params, generators())  # type: ignore[arg-type]
    assert got.token_ids == want.token_ids
    assert got.nonfinite_rows == ([2] if bad is not None else [])
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-6)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-6)
    greedy = Sampler(kernels).sample(logits, [SamplingParams(temperature=0)] * 7, [None] * 7)  # type: ignore[arg-type]
    assert (
        greedy.token_ids
        == Sampler().sample(logits, [SamplingParams(temperature=0)] * 7, [None] * 7).token_ids
    )


def test_the_kernels_logprobs_stay_finite_at_extreme_logits(kernels: object) -> None:
    logits = torch.tensor([[3e38, -3e38, 0.0], [-3e38, 3e38, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=0)] * 2
    out = Sampler(kernels).sample(logits, params, [None, None])  # type: ignore[arg-type]
    assert out.token_ids == [0, 1]
    assert [lp.logprob for lp in out.logprobs if lp is not None] == [0.0, 0.0]


# -- logit bias and penalties (adjust_logits) ------------------------------------------------------

_F32 = torch.finfo(torch.float32)


def adjust_logits_reference(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory | None]
) -> torch.Tensor:
    """:func:`adjust_logits` token by token in Python, as OpenAI's and vLLM's documents state it
    (``mu[j] -> mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty``): the tests'
    reference."""
    out = logits.clone()
    for r, p in enumerate(params):
        history = histories[r]
        if not p.adjusts_logits or history is None:
            continue
        row = out[r].tolist()
        for token, bias in p.logit_bias:
            row[token] += bias
        for token in set(history.token_ids):
            if p.repetition_penalty != 1.0:
                value = row[token]
                row[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        output = list(history.token_ids[history.num_prompt_tokens :])
        for token in set(output):
            row[token] -= output.count(token) * p.frequency_penalty + p.presence_penalty
        out[r] = torch.tensor(row, dtype=out.dtype).clamp(_F32.min, _F32.max)
        if p.allowed_token_ids is not None:
            for token in set(range(out.shape[1])) - set(p.allowed_token_ids):
                out[r, token] = _F32.min
        for token in history.held_back:
            out[r, token] = _F32.min
    return out


def test_bias_then_repetition_then_frequency_and_presence_by_hand() -> None:
    """One row worked out on paper: prompt [0], output [2, 2, 1]."""
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 4.0]])
    params = SamplingParams(
        logit_bias=((3, 1.0), (4, -4.0)), repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    got = adjust_logits(logits, [params], [TokenHistory([0, 2, 2, 1], 1)])
    # 0: seen, positive: 1 / 2. 1: seen, negative: -1 * 2, once in the output: -2 - 0.5 - 0.25.
    # 2: seen: 2 / 2, twice in the output: 1 - 1.0 - 0.25. 3 and 4: never seen, biased: 0.5 + 1, 4 - 4.
    assert got.tolist() == [[0.5, -2.75, -0.25, 1.5, 0.0]]
    assert logits.tolist() == [[1.0, -1.0, 2.0, 0.5, 4.0]]  # a new tensor; the raw row is the logprobs'


def test_adjust_logits_matches_the_formulas_token_by_token() -> None:
    g = gen(5)
    vocab = 60
    logits = torch.randn(6, vocab, generator=g) * 3
    params = [
        SamplingParams(),  # untouched
        SamplingParams(logit_bias=((3, 5.0), (7, -100.0), (59, 0.5))),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(
            logit_bias=((1, 2.5),), repetition_penalty=1.8, frequency_penalty=-1.5, presence_penalty=2.0
        ),
    ]
    histories = [TokenHistory(torch.randint(0, vocab, (40,), generator=g).tolist(), 25) for _ in params]
    got = adjust_logits(logits, params, histories)
    want = adjust_logits_reference(logits, params, histories)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], logits[0])
    assert all(not torch.equal(got[r], logits[r]) for r in range(1, len(params)))
    # no output yet (a prefill's first token): frequency and presence change nothing
    first = adjust_logits(logits[4:5], params[4:5], [TokenHistory([1, 2, 3], 3)])
    assert torch.equal(first, logits[4:5])


def test_adjusted_rows_stay_finite() -> None:
    """A repetition penalty near 0 divides a positive logit past float32, a large one multiplies a
    negative one past it: both land clamped, and the rows are still sampled (no None, no NaN)."""
    logits = torch.tensor([[3e38, -3e38, 1.0], [-3e38, 2.0, 1.0]])
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1e-3, seed=1),
        SamplingParams(
            temperature=0.7, logit_bias=((0, -100.0),), repetition_penalty=1e3, presence_penalty=2.0
        ),
    ]
    histories = [TokenHistory([0, 1], 2), TokenHistory([2, 0], 1)]
    adjusted = adjust_logits(logits, params, histories)
    assert adjusted.isfinite().all()
    assert adjusted[0].tolist() == [_F32.max, pytest.approx(-3e35, rel=1e-6), 1.0]
    assert adjusted[1].tolist() == [_F32.min, 2.0, pytest.approx(1e-3)]
    out = Sampler().sample(logits, params, [gen(1), None], histories)
    assert out.nonfinite_rows == [] and out.token_ids[0] == 0


@pytest.mark.parametrize("native", [False, True])
def test_greedy_and_random_rows_are_chosen_from_the_adjusted_logits(kernels: object, native: bool) -> None:
    """A bias of 100 decides a greedy row and a random one; a penalty moves a greedy row off its
    argmax; rows that ask for nothing are chosen as before; logprobs stay the raw row's."""
    sampler = Sampler(kernels if native else None)  # type: ignore[arg-type]
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4)
    params = [
        SamplingParams(temperature=0, logit_bias=((2, 100.0),), logprobs=1),
        SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=0),  # 1 generated twice: 3 - 4
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, logit_bias=((0, 100.0),), seed=3),
    ]
    histories = [TokenHistory([1], 1), TokenHistory([0, 1, 1], 1), None, TokenHistory([1], 1)]
    out = sampler.sample(logits, params, [None, None, None, gen(3)], histories)
    assert out.token_ids == [2, 3, 1, 0]
    raw = torch.log_softmax(logits[0], dim=-1).tolist()
    lp0, lp1 = out.logprobs[0], out.logprobs[1]
    assert lp0 is not None and lp0.logprob == pytest.approx(raw[2]) and lp0.top[0][0] == 1
    assert lp1 is not None and lp1.logprob == pytest.approx(raw[3])
    all_greedy = sampler.sample(logits[:3], params[:3], [None] * 3, histories[:3])
    assert all_greedy.token_ids == [2, 3, 1]


def test_a_row_that_adjusts_its_logits_needs_its_tokens() -> None:
    with pytest.raises(ValueError, match="pass histories"):
        Sampler().sample(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], [None])


def penalized_batch(vocab: int) -> tuple[torch.Tensor, list[SamplingParams], list[TokenHistory | None]]:
    """Rows of every kind: none, bias alone, each penalty alone, all of them, penalties near 0 and
    huge on logits near float32's bounds, nothing generated yet; histories with repeats. Then masks:
    allowed tokens alone (one of them held back), with a bias lifting a token outside them and a
    penalty, and bad words' held-back tokens with penalties (repeats among them)."""
    g = gen(vocab)
    logits = torch.randn(12, vocab, generator=g) * 4
    logits[6, :4] = torch.tensor([3e38, -3e38, 1e30, -1e30])
    logits[7, :4] = torch.tensor([3e38, -3e38, 1e30, -1e30])
    params = [
        SamplingParams(),
        SamplingParams(logit_bias=((0, 100.0), (vocab - 1, -100.0), (3, 0.25))),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.25),
        SamplingParams(
            logit_bias=((2, -3.0),), repetition_penalty=0.8, frequency_penalty=-2.0, presence_penalty=2.0
        ),
        SamplingParams(repetition_penalty=1e-3, frequency_penalty=2.0),
        SamplingParams(repetition_penalty=1e3, presence_penalty=2.0, logit_bias=((1, -100.0),)),
        SamplingParams(repetition_penalty=1.1, frequency_penalty=1.0, presence_penalty=1.0),
    ]
    params += [
        SamplingParams(allowed_token_ids=(vocab - 1, 2, 0, 5 % vocab)),
        SamplingParams(allowed_token_ids=(1, 3), logit_bias=((0, 100.0), (1, -2.0)), repetition_penalty=1.5),
        SamplingParams(bad_words=((4 % vocab,), (0, 1, 6 % vocab), (4 % vocab,)), frequency_penalty=1.0),
    ]
    histories: list[TokenHistory | None] = [None]
    for r in range(1, 12):
        tokens = torch.randint(0, min(vocab, 40), (60,), generator=g).tolist() + [0, 1, 2, 3, 0, 1]
        held_back = banned_by_bad_words(params[r].bad_words, tokens, 60) + (2,) * (r == 9)  # the engine's way
        histories.append(TokenHistory(tokens, 60 if r != 8 else len(tokens), held_back))  # row 8: no output
    assert histories[11] is not None and histories[11].held_back == (4 % vocab, 6 % vocab, 4 % vocab)
    return logits, params, histories


@pytest.mark.parametrize("vocab", [7, 700, 8192])
def test_the_kernels_penalties_equal_torchs_bit_for_bit(kernels: object, vocab: int) -> None:
    logits, params, histories = penalized_batch(vocab)
    want = adjust_logits(logits, params, histories)
    got = adjust_logits_native(kernels, logits, params, histories)  # type: ignore[arg-type]
    assert torch.equal(got, want)
    assert got.isfinite().all() and not torch.equal(got[6], logits[6]) and torch.equal(got[0], logits[0])
    assert torch.allclose(want, adjust_logits_reference(logits, params, histories), rtol=1e-6, atol=1e-6)
    # the masks: lowest outside the allowed tokens (the bias of 100 on token 0 stays out of row 10)
    assert (want[9] > _F32.min).nonzero().squeeze(1).tolist() == sorted({0, 5 % vocab, vocab - 1} - {2})
    assert (want[10] > _F32.min).nonzero().squeeze(1).tolist() == [1, 3]
    assert (want[11] == _F32.min).nonzero().squeeze(1).tolist() == sorted({4 % vocab, 6 % vocab})
    as_arrays = [
        None if h is None else TokenHistory(array.array("q", h.token_ids), h.num_prompt_tokens, h.held_back)
        for h in histories
    ]
    assert torch.equal(adjust_logits_native(kernels, logits, params, as_arrays), want)  # type: ignore[arg-type]
    for native in (Sampler(kernels), Sampler()):  # type: ignore[arg-type]
        greedy = [SamplingParams(**{**p.__dict__, "temperature": 0.0}) for p in params]
        out = native.sample(logits, greedy, [None] * len(params), histories)
        assert out.token_ids == want.argmax(dim=-1).tolist()


def test_the_kernels_penalties_refuse_what_they_cannot_read(kernels: object) -> None:
    scores = torch.zeros(2, 8)
    one = torch.tensor([0])

    def call(tokens: list[int], rows: torch.Tensor = one, offsets: list[int] | None = None) -> None:
        kernels.adjust_rows_(  # type: ignore[attr-defined]
            scores, rows, torch.tensor(tokens, dtype=torch.long), torch.tensor(offsets or [0, len(tokens)]),
            torch.tensor([0]), torch.tensor([[1.5, 0.0, 0.0]], dtype=torch.float64),
        )  # fmt: skip

    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        call([1, 8])
    with pytest.raises(RuntimeError, match="outside the scores"):
        call([1], rows=torch.tensor([2]))
    with pytest.raises(RuntimeError, match="offsets must run from 0"):
        call([1, 2], offsets=[0, 1])
    assert torch.equal(scores, torch.zeros(2, 8))  # refused before anything was written


@pytest.mark.parametrize("native", [False, True])
def test_held_back_tokens_are_never_chosen(kernels: object, native: bool) -> None:
    """``min_tokens`` not reached: the engine holds back a row's eos and stop tokens (TokenHistory's
    ``held_back``), greedy and random rows alike, the others untouched; logprobs stay raw."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 3)
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(1,), logprobs=0),
        SamplingParams(temperature=1.0, seed=1, min_tokens=2, stop_token_ids=(1, 3)),
        SamplingParams(temperature=0, min_tokens=1),  # reached: nothing held back
    ]
    histories = [TokenHistory([0], 1, (1,)), TokenHistory([0], 1, (1, 3)), TokenHistory([0, 2], 1)]
    sampler = Sampler(kernels if native else None)  # type: ignore[arg-type]
    for seed in range(20):
        out = sampler.sample(logits, params, [None, gen(seed), None], histories)
        assert out.token_ids[0] == 3 and out.token_ids[1] in (0, 2) and out.token_ids[2] == 1
    lp = out.logprobs[0]
    assert lp is not None and lp.logprob == pytest.approx(torch.log_softmax(logits[0], dim=-1)[3].item())
    want = adjust_logits(logits, params, histories)
    assert torch.equal(adjust_logits_native(kernels, logits, params, histories), want)  # type: ignore[arg-type]
    assert want[0, 1].item() == _F32.min and want[1, 3].item() == _F32.min and torch.equal(want[2], logits[2])


@pytest.mark.parametrize("native", [False, True])
def test_only_allowed_token_ids_are_chosen(kernels: object, native: bool) -> None:
    """Greedy and random (seeded and not) rows with ``allowed_token_ids`` beside a row without:
    each masked row takes only its allowed tokens, whatever its bias says of the others (the mask
    comes after it); logprobs stay the raw row's. A row whose only allowed token is held back is
    all lowest, and a greedy row then takes token 0 (the first of equal values)."""
    vocab = 64
    logits = torch.randn(5, vocab, generator=gen(2))
    logits[:, 10] = 50.0  # every row's argmax, allowed in none of the masked rows
    logits[:, [3, 7, 40]] = torch.tensor([1.0, 1.5, 0.5])
    params = [
        SamplingParams(temperature=0, allowed_token_ids=(3, 7, 40), logprobs=0),
        SamplingParams(temperature=1.5, seed=5, allowed_token_ids=[40, 3, 7]),  # type: ignore[arg-type]
        SamplingParams(temperature=0.8, allowed_token_ids=(5, 6), logit_bias=((10, 100.0), (6, -100.0))),
        SamplingParams(temperature=0),  # no mask
        SamplingParams(temperature=0, allowed_token_ids=(9,), min_tokens=1, stop_token_ids=(9,)),
    ]
    histories = [
        TokenHistory([1], 1),
        TokenHistory([1], 1),
        TokenHistory([1], 1),
        None,
        TokenHistory([1], 1, (9,)),
    ]
    sampler = Sampler(kernels if native else None)  # type: ignore[arg-type]
    drawn = []
    for seed in range(30):
        out = sampler.sample(logits, params, [None, gen(seed), None, None, None], histories)
        assert [out.token_ids[r] for r in (0, 2, 3, 4)] == [7, 5, 10, 0]
        drawn.append(out.token_ids[1])
    assert set(drawn) == {3, 7, 40}  # it really samples, among the allowed tokens only
    lp = out.logprobs[0]
    assert lp is not None and lp.logprob == pytest.approx(torch.log_softmax(logits[0], dim=-1)[7].item())
    all_greedy = sampler.sample(logits[[0, 3, 4]], [params[0], params[3], params[4]], [None] * 3,
                                [histories[0], None, histories[4]])  # fmt: skip
    assert all_greedy.token_ids == [7, 10, 0]


def test_bad_words_ban_a_words_last_token_where_the_output_ends_with_the_rest() -> None:
    """vLLM's apply_bad_words: a one-token word always; a longer one when the output's last tokens
    are its others, the prompt never counting."""
    words = ((5,), (7, 8, 9), (2, 3), (3, 4, 6))
    prompt = [3, 7, 8]  # holds (3,) and ends with (7, 8): the prompt does not count
    assert banned_by_bad_words(words, prompt, 3) == (5,)  # nothing out yet: the one-token word alone
    assert banned_by_bad_words(words, prompt + [8], 3) == (5,)  # (7, 8): 7 is the prompt's
    assert banned_by_bad_words(words, prompt + [2], 3) == (5, 3)
    assert banned_by_bad_words(words, prompt + [7, 8], 3) == (5, 9)
    assert banned_by_bad_words(words, prompt + [7, 8, 1], 3) == (5,)  # the prefix must end the output
    assert banned_by_bad_words(words, prompt + [3, 4], 3) == (5, 6)
    assert banned_by_bad_words(words, prompt + [9, 4], 3) == (5,)  # (3, 4) does not match (9, 4)
    assert banned_by_bad_words(words, prompt + [4], 3) == (5,)  # (3, 4): 3 is the prompt's
    assert banned_by_bad_words(words, array.array("q", [0, 2, 7, 8]), 1) == (5, 9)  # the engine's history
    assert banned_by_bad_words(((1,), (1,), (0, 1)), [0], 0) == (1, 1, 1)  # repeats kept, all output
    assert banned_by_bad_words((), [0, 1], 1) == ()
