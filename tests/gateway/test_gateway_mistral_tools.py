"""tool_choice auto in Mistral's format, through a real worker and a gateway started with
``--tool-call-parser mistral``: the model's ``[TOOL_CALLS]`` is a special token, which the text
must keep for the parser to find the calls.

The tiny model's tokenizer gets a ``[TOOL_CALLS]`` special token (its id 3, renamed; the weights
do not care what a token is called), and a grammar makes the random model write the format.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from gateway_support import MODEL_NAME, gateway_url, start_gateway, start_worker, stop_process, wait_ready
from yutu.engine.testing import make_tiny_checkpoint, rename_special_tokens
from yutu.engine.tokenizer import Tokenizer

TOOL_CALLS = 3  # the id of <|end_header_id|> in the tiny tokenizer, renamed [TOOL_CALLS] here
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
           "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


def mistral_like(directory: Path) -> Path:
    """A tiny checkpoint whose special token 3 is [TOOL_CALLS]."""
    model = make_tiny_checkpoint(directory, arch="llama", seed=0)
    rename_special_tokens(model, {TOOL_CALLS: "[TOOL_CALLS]"})
    tok = Tokenizer.from_dir(model)
    assert tok.id_to_token(TOOL_CALLS) == "[TOOL_CALLS]" and TOOL_CALLS in tok.special_token_ids
    return model


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[openai.OpenAI]:
    model = mistral_like(tmp_path_factory.mktemp("mistral-model") / "tiny")
    prefix = f"yutu-mistral-{uuid.uuid4().hex[:8]}"
    logs = tmp_path_factory.mktemp("mistral-stack")
    worker = start_worker(logs, model, redis_url, prefix)
    gateway = start_gateway(logs, model, redis_url, prefix, "--tool-call-parser", "mistral")
    try:
        url = gateway_url(redis_url, prefix, gateway)
        wait_ready(url, [worker, gateway])
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    finally:
        stop_process(gateway)
        stop_process(worker)


@pytest.mark.parametrize(
    "written",
    [
        f'"Let me check." <[{TOOL_CALLS}]> "[{{\\"name\\": \\"weather\\", \\"arguments\\": {{\\"city\\": \\"Oslo\\"}}}}]"',
        f'"Let me check." <[{TOOL_CALLS}]> "weather[ARGS]{{\\"city\\": \\"Oslo\\"}}"',
    ],
    ids=["json-array", "v11"],
)
def test_mistral_calls_are_found_after_the_special_token(client: openai.OpenAI, written: str) -> None:
    """Both of Mistral's formats: the text before [TOOL_CALLS] is content, the call a tool call
    with a nine-character id, finish_reason tool_calls; streamed: the content as it comes, then
    the call."""
    args: dict[str, Any] = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                tools=[WEATHER], max_tokens=60, temperature=0,
                                extra_body={"structured_outputs": {"grammar": f"start: {written}"}})  # fmt: skip
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("weather", {"city": "Oslo"})
    assert len(call.id) == 9 and call.id.isalnum()
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Let me check."
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments or "")) for d in deltas if d.function] == [
        ("weather", {"city": "Oslo"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_text_without_the_special_token_is_content(client: openai.OpenAI) -> None:
    """The same call written as plain text, without [TOOL_CALLS], is no call; and a request
    without tools keeps its special tokens out of the text, as by default."""
    written = '"[{\\"name\\": \\"weather\\", \\"arguments\\": {}}]"'
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], max_tokens=60,
        temperature=0, extra_body={"structured_outputs": {"grammar": f"start: {written}"}},
    )  # fmt: skip
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == '[{"name": "weather", "arguments": {}}]'
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"grammar": f'start: "a" <[{TOOL_CALLS}]> "b"'}},
    )  # fmt: skip
    assert plain.choices[0].message.content == "ab"
