"""The gateway's tokenizer work: cheap refusals first, small texts inline, large ones on a bounded pool.

Three rules keep one huge prompt from costing everyone else:

1. A text proved longer than the context (see ``yutu.engine.token_span``: more characters, or
   UTF-8 bytes, than ``max_model_len`` tokens could ever cover) is refused (400,
   ``context_length_exceeded``) before it is tokenized. Nothing that could fit is refused by this rule; whatever passes is tokenized and
   then counted exactly.
2. Texts up to INLINE_CHARS characters are tokenized on the event loop (microseconds: a thread
   hop would cost more). Longer ones go to a small dedicated thread pool (``threads`` wide, sized
   to the machine by default), so large prompts queue among themselves while small requests are
   served at once; the Rust tokenizer releases the GIL while it encodes.
3. After a large job the heap is trimmed (memory.py), so the memory goes back to the OS.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from yutu.engine.token_span import TokenSpan, token_span
from yutu.engine.tokenizer import Tokenizer

from services.gateway.errors import context_length_exceeded
from services.gateway.memory import LARGE_REQUEST_BYTES, MemoryReleaser

T = TypeVar("T")

INLINE_CHARS = 20_000  # texts up to this many characters are tokenized on the event loop


def default_threads() -> int:
    """Half the CPUs this process may use (1 to 8): the event loop and the other work keep the rest."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


class PromptTokenizer:
    """Tokenization as the routes use it; ``close()`` when the service stops."""

    def __init__(self, tokenizer: Tokenizer, threads: int, releaser: MemoryReleaser) -> None:
        if threads < 1:
            raise ValueError(f"the tokenizer pool needs at least one thread, got {threads}")
        self.tokenizer = tokenizer
        self.span: TokenSpan | None = token_span(tokenizer.backend)  # None: no cheap refusal
        self.threads = threads
        self.releaser = releaser
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def info(self) -> dict[str, Any]:
        span = None if self.span is None else {"chars": self.span.chars, "bytes": self.span.bytes}
        return {"threads": self.threads, "inline_chars": INLINE_CHARS, "token_span": span}

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: inline when ``size`` (characters of input) is small, else on the pool."""
        if size <= INLINE_CHARS:
            return fn(*args)
        try:
            return await self.off_loop(fn, *args)
        finally:
            if size >= LARGE_REQUEST_BYTES:
                self.releaser.soon()

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the pool (other CPU work of a request's: a grammar's compile)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))

    def check_length(self, text: str, max_model_len: int | None, param: str) -> None:
        """Refuse ``text`` (413, context_length_exceeded) if it cannot fit ``max_model_len`` tokens.

        Costs O(1) for a text too long by characters and O(len) otherwise (its UTF-8 length),
        never a tokenization. No-op without a context length or a provable span.
        """
        span = self.span
        if span is None or max_model_len is None:
            return
        chars = len(text)
        if span.too_long(chars, None, max_model_len):
            what = f"{chars} characters, and no token of this model covers more than {span.chars}"
            self._refuse(math.ceil(chars / span.chars), what, max_model_len, param)
        if text.isascii():
            return  # bytes == chars, and span.bytes >= span.chars
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if span.too_long(chars, num_bytes, max_model_len):
            what = f"{num_bytes} bytes of UTF-8, and no token of this model covers more than {span.bytes}"
            self._refuse(math.ceil(num_bytes / span.bytes), what, max_model_len, param)

    @staticmethod
    def _refuse(at_least: int, what: str, max_model_len: int, param: str) -> None:
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has at"
            f" least {at_least} tokens ({what}): shorten the {param}",
            param,
        )

    async def encode(
        self, texts: list[str], max_model_len: int | None, param: str, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each text, after refusing any text proved too long for the context."""
        for text in texts:
            self.check_length(text, max_model_len, param)
        encode = self.tokenizer.encode
        size = sum(len(t) for t in texts)
        return await self.run(size, lambda: [encode(t, add_special_tokens) for t in texts])

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        max_model_len: int | None,
        param: str = "messages",
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        """Token ids of the messages rendered with the chat template (as ``Tokenizer.encode_chat``),
        ``tools`` (OpenAI's tool definitions) passed to it as the template variable ``tools``, and
        ``template_kwargs`` as variables of their names (``continue_final_message``, ``chat_template``:
        see ``Tokenizer.apply_chat_template``).

        The rendered text is what gets refused by length: a template may add to the messages or
        leave some out. Raises ChatTemplateError.
        """
        size = sum(len(str(m.get("content", ""))) for m in messages) + len(str(tools or ""))
        size += len(chat_template or "")
        render = partial(
            self.tokenizer.apply_chat_template,
            tools=tools,
            chat_template=chat_template,
            **(template_kwargs or {}),
        )
        text = await self.run(size, render, messages, add_generation_prompt, continue_final_message)
        (ids,) = await self.encode([text], max_model_len, param, add_special_tokens=False)
        return ids

    async def decode(self, ids: list[int]) -> str:
        return await self.run(len(ids) * 4, self.tokenizer.decode, ids)
