"""Tokenizer: encode/decode, special tokens, chat templates, incremental detokenization."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers
from yutu.engine.demo_tokenizer import CHAT_TEMPLATE, demo_corpus
from yutu.engine.testing import make_tiny_checkpoint
from yutu.engine.tokenizer import ChatTemplateError, IncrementalDetokenizer, ReferenceDetokenizer, Tokenizer

TEXTS = [
    "Hello, world! The jade rabbit pounds mooncakes.",
    "月亮上住着一只玉兔，它每天都在捣药。",
    "emoji 🐇🌕🥮 mixed with 中文 and café naïve",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "",
    "🤖" * 5 + "边" * 3,
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi 🐇 there  "},
]
RENDERED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi 🐇 there<|eot_id|>"
)
GEN_PROMPT = "<|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_ids_and_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 512
    assert tok.bos_token_id == 0 and tok.id_to_token(0) == "<|begin_of_text|>"
    assert tok.eos_token_ids == (4, 1)  # tokenizer_config eos (<|eot_id|>), then generation_config
    assert tok.token_to_id("<|eot_id|>") == 4


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text  # BOS skipped
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_multibyte_characters_split_across_tokens(tok: Tokenizer) -> None:
    """The tiny vocab has no token for 🐇: its four UTF-8 bytes span several tokens."""
    ids = tok.encode("🐇", add_special_tokens=False)
    assert len(ids) > 1
    assert "\ufffd" in tok.decode(ids[:1])


def test_chat_template_rendering(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(MESSAGES) == RENDERED + GEN_PROMPT
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == RENDERED
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(0) == 1 and ids[0] == tok.bos_token_id == 0  # no double BOS
    assert tok.decode(ids, skip_special_tokens=False) == RENDERED + GEN_PROMPT


def test_chat_template_matches_transformers(model_dir: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    for gen in (True, False):
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == hf.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=gen
        )
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)


def test_a_continued_final_message_and_template_variables_match_transformers(
    model_dir: Path, tmp_path: Path, tok: Tokenizer
) -> None:
    """continue_final_message (the last message left open: what the template puts after its text
    is cut) and extra template variables (vLLM's chat_template_kwargs), against transformers'
    apply_chat_template, the reference."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    for last in ("The jade rabbit", "  spaced answer  "):  # the template trims the second
        messages = [*MESSAGES, {"role": "assistant", "content": last}]
        got = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        assert got == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        assert got.endswith(last.strip())
    with pytest.raises(ChatTemplateError, match="last message with text"):
        tok.apply_chat_template([*MESSAGES, {"role": "assistant", "content": " "}], False, True)
    thinking = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is false %}/no_think{% endif %}"
    variant = Tokenizer.from_dir(_tokenizer_with(model_dir, tmp_path, chat_template=thinking))
    hf_variant = transformers.AutoTokenizer.from_pretrained(tmp_path / "variant")
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        assert variant.apply_chat_template(MESSAGES, **kwargs) == hf_variant.apply_chat_template(
            MESSAGES, tokenize=False, **kwargs
        )
    assert variant.apply_chat_template(MESSAGES, enable_thinking=False).endswith("/no_think")
    (tmp_path / "counts").mkdir()
    counts = Tokenizer.from_dir(
        _tokenizer_with(model_dir, tmp_path / "counts", chat_template="{{ messages | length }}")
    )
    with pytest.raises(ChatTemplateError, match="does not show the last message"):
        counts.apply_chat_template([{"role": "user", "content": "abc"}], False, True)


def test_chat_template_raise_exception(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="message content must be a string"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def _tokenizer_with(model_dir: Path, tmp_path: Path, **config_changes: object) -> Path:
    out = tmp_path / "variant"
    out.mkdir()
    (out / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_template_features(model_dir: Path, tmp_path: Path) -> None:
    """tojson (non-ASCII kept), loop controls, {% generation %}, trim_blocks, extra variables, eos_token."""
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
        "{{ tools | tojson }}|{{ eos_token }}"
    )
    t = Tokenizer.from_dir(_tokenizer_with(model_dir, tmp_path, chat_template=template))
    out = t.apply_chat_template(
        [{"role": "user", "content": "月"}, {"role": "skip", "content": "x"}], tools=[{"name": "f"}]
    )
    assert out == '{"role": "user", "content": "月"}[{"name": "f"}]|<|eot_id|>'  # trim_blocks ate the newline


def test_template_sources(model_dir: Path, tmp_path: Path) -> None:
    # A list of named templates: "default" wins.
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    d = _tokenizer_with(model_dir, tmp_path, chat_template=named)
    assert Tokenizer.from_dir(d).apply_chat_template(MESSAGES) == "D<|begin_of_text|>"
    # chat_template.jinja beside the config takes precedence (how transformers >= 4.43 saves it).
    (d / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_dir(d).apply_chat_template(MESSAGES) == "J2"


def test_no_template_and_bad_template(model_dir: Path, tmp_path: Path) -> None:
    t = Tokenizer.from_dir(_tokenizer_with(model_dir, tmp_path, chat_template=None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        t.apply_chat_template(MESSAGES)
    t.chat_template = "{% for %}"
    with pytest.raises(ChatTemplateError, match="does not parse"):
        t.apply_chat_template(MESSAGES)


def test_special_tokens_as_added_token_dicts(model_dir: Path, tmp_path: Path) -> None:
    d = _tokenizer_with(
        model_dir,
        tmp_path,
        eos_token={"content": "<|end_of_text|>", "special": True},
        chat_template=CHAT_TEMPLATE,
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == (1, 4)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


DETOKENIZERS = [IncrementalDetokenizer, ReferenceDetokenizer]
Detokenizer = type[IncrementalDetokenizer] | type[ReferenceDetokenizer]


def _stream(
    tok: Tokenizer,
    prompt: list[int],
    ids: list[int],
    rng: random.Random,
    cls: Detokenizer = IncrementalDetokenizer,
) -> tuple[list[str], str]:
    detok = cls(tok, prompt)
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    return deltas, detok.flush()


@pytest.mark.parametrize("cls", DETOKENIZERS)
@pytest.mark.parametrize("seed", range(20))
def test_incremental_detokenizer_random_streams(tok: Tokenizer, seed: int, cls: Detokenizer) -> None:
    """Random ids (so random bytes: broken UTF-8 too, and special tokens) equal one full decode."""
    rng = random.Random(seed)
    prompt = tok.encode(rng.choice(TEXTS[:3])) if seed % 2 else []
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
    deltas, tail = _stream(tok, prompt, ids, rng, cls)
    assert "".join(deltas) + tail == tok.decode(ids)


@pytest.mark.parametrize("seed", range(100))
def test_the_streaming_detokenizer_agrees_with_the_reference_delta_for_delta(
    tok: Tokenizer, seed: int
) -> None:
    rng = random.Random(1000 + seed)
    prompt = tok.encode(rng.choice(TEXTS)) if seed % 3 else []
    if seed % 2:  # random ids: broken UTF-8 and special tokens
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 80))]
    else:  # real text, multi-byte characters split across ids
        ids = tok.encode(" ".join(rng.sample(TEXTS, 2)), add_special_tokens=False)
    fast = _stream(tok, prompt, ids, random.Random(seed), IncrementalDetokenizer)
    reference = _stream(tok, prompt, ids, random.Random(seed), ReferenceDetokenizer)
    assert fast == reference


@pytest.mark.parametrize("cls", DETOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_never_emits_half_characters(
    tok: Tokenizer, text: str, cls: Detokenizer
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Question: 你好?")
    deltas, tail = _stream(tok, prompt, ids, random.Random(0), cls)
    assert "".join(deltas) == text and tail == ""
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("cls", DETOKENIZERS)
def test_incremental_detokenizer_holds_back_partial_emoji(tok: Tokenizer, cls: Detokenizer) -> None:
    ids = tok.encode("a🐇", add_special_tokens=False)
    detok = cls(tok, [])
    assert detok.push(ids[:1]) == "a"
    assert [detok.push([i]) for i in ids[1:-1]] == [""] * (len(ids) - 2)
    assert detok.push(ids[-1:]) == "🐇"
    assert detok.flush() == "" and detok.token_ids == ids


@pytest.mark.parametrize("cls", DETOKENIZERS)
def test_incremental_detokenizer_keeps_sentencepiece_spaces(cls: Detokenizer) -> None:
    """Metaspace decoders (Llama 2, Mistral) drop the leading space of a decode's first token; the
    detokenizer decodes with prompt context, so the space between prompt and answer survives."""
    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator([d for d in demo_corpus() if d.isascii()], trainer=trainer)
    tok = Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})
    text = "Question: the moon rabbit pounds herbs"
    ids = tok.encode(text)
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]) == "Question:")
    assert tok.decode(ids[split:]) == "the moon rabbit pounds herbs"  # the space is lost alone
    detok = cls(tok, ids[:split])
    assert "".join(detok.push([i]) for i in ids[split:]) + detok.flush() == " the moon rabbit pounds herbs"
