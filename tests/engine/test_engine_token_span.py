"""token_span: the most text one token can stand for, never too small (a prompt that fits is never refused)."""

from __future__ import annotations

from functools import cache

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from yutu.engine.testing import tiny_tokenizer
from yutu.engine.token_span import TokenSpan, token_span

_CORPUS = [
    "The jade rabbit lives on the moon and pounds the herbs of immortality.",
    "月亮上住着一只玉兔，它每天都在捣药。 Café naïve résumé ünter straße.",
    "def add(a, b):\n    return a + b\n\n\n        indented        spaces",
    "🐇 🌕 🥮 1234567890 ==================== ------------ ____",
] * 20


def _demo() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(tiny_tokenizer().tokenizer_json)


@cache
def _sentencepiece_like(nfc: bool) -> tokenizers.Tokenizer:
    """Llama 2 / Mistral style: "▁" for spaces, byte fallback, no pre-tokenizer (optionally NFC first)."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    steps: list[normalizers.Normalizer] = [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    if nfc:
        steps.insert(0, normalizers.NFC())
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


def _qwen_like() -> tokenizers.Tokenizer:
    """Byte-level BPE with an NFC normaliser in front (as Qwen2's tokenizer.json)."""
    tok = tokenizers.Tokenizer.from_str(tiny_tokenizer().tokenizer_json)
    tok.normalizer = normalizers.NFC()
    return tok


TOKENIZERS = {
    "byte-level": _demo,
    "sentencepiece": lambda: _sentencepiece_like(False),
    "sentencepiece-nfc": lambda: _sentencepiece_like(True),
    "byte-level-nfc": _qwen_like,
}

# Text that tokenizers pack densely or normalisers shrink: long runs of one character, whitespace,
# decomposed accents and Hangul jamo (NFC composes them), special-token spellings, the longest pieces.
_ATOMS = st.sampled_from(
    ["a", " ", "  ", "\n", "=", "-", "_", "0", "the", "moon", "e\u0301", "\u1100\u1161\u11a8",
     "\u03c9\u0313\u0300\u0345", "月", "🐇", "<|start_header_id|>", "<s>", "▁", "\u212a", "ﬁ"]
)  # fmt: skip
_TEXTS = st.lists(st.tuples(_ATOMS, st.integers(1, 200)), min_size=1, max_size=8).map(
    lambda parts: "".join(atom * count for atom, count in parts)
) | st.text(min_size=1, max_size=400)


def _assert_bound_holds(tok: tokenizers.Tokenizer, span: TokenSpan, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(text) <= len(ids) * span.chars, (text[:80], len(ids), span)
    assert len(text.encode("utf-8")) <= len(ids) * span.bytes, (text[:80], len(ids), span)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXTS)
def test_no_text_encodes_to_fewer_tokens_than_its_length_over_the_span(name: str, text: str) -> None:
    tok = TOKENIZERS[name]()
    span = token_span(tok)
    assert span is not None
    _assert_bound_holds(tok, span, text)


def test_span_of_the_demo_tokenizer_is_its_longest_piece() -> None:
    # "<|start_header_id|>" (19 characters, 19 bytes) is the longest token, an added one.
    assert token_span(_demo()) == TokenSpan(chars=19, bytes=19)
    repeated = "<|start_header_id|>" * 50  # the worst case: exactly len / span tokens
    assert len(_demo().encode(repeated, add_special_tokens=False).ids) == len(repeated) // 19


def test_normalisers_multiply_the_span() -> None:
    plain = _sentencepiece_like(False)
    base = token_span(plain)
    assert base is not None
    # NFC composes up to 4 code points (8 bytes) into one character: the span grows by (4, 8).
    assert token_span(_sentencepiece_like(True)) == TokenSpan(base.chars * 4, base.bytes * 8)
    demo = _demo()
    demo.normalizer = normalizers.Replace("abc", "x")  # 3 characters may become 1
    assert token_span(demo) == TokenSpan(19 * 3, 19 * 3)
    # Byte fallback pieces "<0xE4>" (6 characters) count at their spelling: over-counting is safe.
    assert base.chars >= len("<0xE4>")


def _word_level() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))


def _with(tok: tokenizers.Tokenizer, **parts: object) -> tokenizers.Tokenizer:
    for name, value in parts.items():
        setattr(tok, name, value)
    return tok


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1})), id="wordpiece"),
        pytest.param(_word_level, id="wordlevel"),
        pytest.param(
            lambda: tokenizers.Tokenizer(
                models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True)
            ),
            id="bpe-fused-unknowns",
        ),
        pytest.param(lambda: _with(_demo(), normalizer=normalizers.Strip()), id="strip"),
        pytest.param(lambda: _with(_demo(), normalizer=normalizers.Replace("a", "")), id="deleting-replace"),
        pytest.param(
            lambda: _with(_demo(), pre_tokenizer=pre_tokenizers.Whitespace()), id="whitespace-split"
        ),
        pytest.param(
            lambda: _with(_demo(), pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed")), id="removed"
        ),
    ],
)
def test_tokenizers_that_can_swallow_unbounded_text_have_no_span(make: object) -> None:
    assert callable(make)
    assert token_span(make()) is None


def test_whitespace_absorbing_added_tokens_and_truncation_have_no_span() -> None:
    tok = _demo()
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert token_span(tok) is None
    # The unbounded case is real: any run of spaces before "<mask>" is part of that one token.
    assert len(tok.encode(" " * 1000 + "<mask>", add_special_tokens=False).ids) == 1
    truncating = _demo()
    truncating.enable_truncation(16)
    assert token_span(truncating) is None
    assert token_span(_demo()) is not None
