"""A reasoning model's thinking apart from its answer (``--reasoning-parser``, as vLLM's flag).

Reasoning models (Qwen3, DeepSeek R1 and its distillations, QwQ) think between ``<think>`` and
``</think>`` before they answer. With a parser, a chat completion's message carries the thinking
as ``reasoning`` (and ``reasoning_content``, the older name vLLM still sends beside it) and only the
answer as ``content``; streamed, deltas carry ``reasoning`` until the thinking ends, ``content``
after. Tool calls (``tool_choice: "auto"``) are looked for in the answer only.

Where the thinking is, the rendered prompt says first, then the output:

- a prompt that ends with ``</think>`` closed it (Qwen3 with ``enable_thinking: false`` puts an
  empty ``<think>\\n\\n</think>``): the output is all answer;
- a prompt that ends with ``<think>`` opened it (DeepSeek R1's templates, Qwen3.5's), as does one
  whose end holds a ``<think>`` after any ``</think>`` (an assistant's thinking continued, with
  ``continue_final_message``): the output thinks until ``</think>``;
- otherwise the output decides: one that opens with ``<think>`` (whitespace before it aside)
  thinks until ``</think>``, any other is all answer (a model that does not think, say).

Thinking cut short by ``max_tokens`` is all reasoning, with no content.

A constrained output (``response_format``, ``structured_outputs``, a named or required tool choice)
is constrained in its answer only, as vLLM does: where each marker is one token of the model's
vocabulary (Qwen3's, DeepSeek R1's), the engine lets the model think unconstrained and holds the
grammar from the token after ``</think>`` -- or from the first token where the prompt closed the
thinking, or where the first token is not ``<think>`` (SamplingParams' ``grammar_after_thinking``).
Where a marker is several tokens, the grammar holds from the first token, and the output decides.

The qwen3 and deepseek_r1 parsers follow the same rules: both models mark their thinking alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from yutu.engine.tokenizer import Tokenizer

from services.gateway.tool_parsers import partial_marker

PROMPT_TAIL_TOKENS = 64  # tokens of the prompt's end read for an opening or closing marker


@dataclass(frozen=True)
class ReasoningParser:
    """A model family's markers around its thinking."""

    name: str
    start: str = "<think>"
    end: str = "</think>"

    def opened_by(self, prompt_tail: str) -> bool | None:
        """Where a prompt ending in ``prompt_tail`` (its text, special tokens kept) leaves the output:
        True: thinking, False: answering, None: the output decides."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end):
            return False
        if tail.rfind(self.start) > tail.rfind(self.end):  # opened, not closed since
            return True
        return None  # no marker, or an earlier turn's closed thinking

    def marker_ids(self, tokenizer: Tokenizer) -> tuple[int, int] | None:
        """The markers' token ids where each is one token of ``tokenizer``, else None."""
        start, end = tokenizer.token_to_id(self.start), tokenizer.token_to_id(self.end)
        return None if start is None or end is None else (start, end)

    def needs_special_tokens(self, tokenizer: Tokenizer) -> bool:
        """Whether the markers are special tokens of ``tokenizer``, which text keeps only when
        detokenized with ``skip_special_tokens`` false."""
        return any(tokenizer.token_to_id(m) in tokenizer.special_token_ids for m in (self.start, self.end))


PARSERS: dict[str, ReasoningParser] = {name: ReasoningParser(name) for name in ("deepseek_r1", "qwen3")}


@dataclass(frozen=True)
class Thinking:
    """Where one request's thinking is: its gateway's parser and what its prompt says."""

    parser: ReasoningParser
    opened: bool | None  # ReasoningParser.opened_by
    skip_special_tokens: bool  # False: the markers are special tokens, which the text must keep
    grammar_after: tuple[int, int, bool] | None = None  # a grammar's SamplingParams.grammar_after_thinking
    shown: bool = True  # the thinking goes to the client (vLLM's include_reasoning); else it is dropped

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output as (its reasoning, None where it had no thinking; its content)."""
        s = ReasoningSplit(self)
        reasoning, content = s.feed(text)
        more_reasoning, more_content = s.finish()
        return (reasoning + more_reasoning if s.reasoned else None), content + more_content


def thinking_of(
    parser_name: str | None, tokenizer: Tokenizer, prompt: list[int], constrained: bool, shown: bool = True
) -> Thinking | None:
    """A chat request's Thinking on a gateway with ``--reasoning-parser parser_name`` (None: no
    parser, no Thinking); ``constrained``: the output follows a grammar (held after the thinking
    where the markers are single tokens, else from the first token); ``shown``: the request's
    ``include_reasoning``."""
    if parser_name is None:
        return None
    parser = PARSERS[parser_name]
    opened = parser.opened_by(tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
    skip = not parser.needs_special_tokens(tokenizer)
    if not constrained or opened is False:
        return Thinking(parser, opened, skip, shown=shown)
    ids = parser.marker_ids(tokenizer)
    if ids is None:  # the grammar holds from the first token: the output decides
        return Thinking(parser, None, skip, shown=shown)
    return Thinking(parser, opened, skip, (*ids, opened is True), shown)


def skip_special_tokens_for(thinking: Thinking | None, skip_special_tokens: bool) -> bool:
    """``skip_special_tokens`` as the output's text must be detokenized: false where the
    thinking's markers are special tokens, which the split needs to see."""
    return skip_special_tokens and (thinking is None or thinking.skip_special_tokens)


class ReasoningSplit:
    """One choice's output, as it comes, as thinking and answer (the rules above). ``feed`` each
    new piece of text, then ``finish`` once: each returns the (reasoning, content) text ready to
    send; text that may still be part of a marker is held until it is known."""

    def __init__(self, thinking: Thinking) -> None:
        self.parser = thinking.parser
        self.shown = thinking.shown  # False: the thinking is split off, not sent
        self._state = {True: "thinking", False: "answering", None: "undecided"}[thinking.opened]
        self._held = ""  # text not sent yet: maybe the start of a marker
        self.reasoned = thinking.opened is True  # whether the output had thinking (so far)

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        if self._state == "undecided":
            lead = self._held.lstrip()
            if lead.startswith(self.parser.start):
                self._state, self.reasoned = "thinking", True
                self._held = lead[len(self.parser.start) :]
            elif self.parser.start.startswith(lead):
                return "", ""  # nothing, whitespace, or the start marker coming: wait
            else:
                self._state = "answering"
        if self._state == "thinking":
            end = self._held.find(self.parser.end)
            if end < 0:
                cut = partial_marker(self._held, self.parser.end)
                reasoning, self._held = self._held[:cut], self._held[cut:]
                return reasoning, ""
            reasoning = self._held[:end]
            self._held = self._held[end + len(self.parser.end) :]
            self._state = "answering"
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self._state == "thinking" else ("", held)
