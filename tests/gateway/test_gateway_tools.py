"""Tool calling's pure parts: the tool plan a request makes, the model families' call formats,
and a streamed choice's deltas (the real stack's answers are in test_gateway_api.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.errors import ApiError
from services.gateway.schemas import ChatCompletionRequest
from services.gateway.tool_parsers import (
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedCall,
    Phi4MiniJsonParser,
    PythonicParser,
    Qwen3CoderParser,
)
from services.gateway.tools import ChoiceStream, ToolPlan, tool_plan

NOW = {"type": "function", "function": {"name": "now"}}
CITY = {
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/city"}},
    "$defs": {"city": {"type": "string"}},
}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": CITY}}


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_tool_plans() -> None:
    assert tool_plan(request()).mode == "none"
    assert tool_plan(request(tools=[NOW], tool_choice="none")).mode == "none"
    named = tool_plan(
        request(tools=[NOW, WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}})
    )
    assert (named.mode, named.function, named.schema) == ("named", "weather", CITY)
    required = tool_plan(request(tools=[NOW, WEATHER], tool_choice="required"))
    assert required.schema is not None and required.schema["$defs"] == {"city": {"type": "string"}}  # lifted
    options = required.schema["items"]["anyOf"]
    assert [o["properties"]["name"] for o in options] == [{"enum": ["now"]}, {"enum": ["weather"]}]
    assert "$defs" not in options[1]["properties"]["parameters"]
    assert "maxItems" not in required.schema
    single = tool_plan(request(tools=[NOW, WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert single.schema is not None and single.schema["maxItems"] == 1
    assert tool_plan(request(tools=[NOW]), HermesParser()).mode == "auto"
    for fields, param in [
        ({"tools": [NOW]}, "tool_choice"),  # auto without a parser
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "later"}}}, "tool_choice"),
        ({"tools": [NOW, NOW], "tool_choice": "none"}, "tools"),
    ]:
        with pytest.raises(ApiError) as err:
            tool_plan(request(**fields))
        assert err.value.param == param


def test_hermes_calls() -> None:
    p = HermesParser()
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert p.parse("It is " + call + "\n" + call.replace("Oslo", "Rome")) == (
        "It is ",
        [ParsedCall("weather", '{"city": "Oslo"}'), ParsedCall("weather", '{"city": "Rome"}')],
    )
    assert p.parse(call)[1] == [ParsedCall("weather", '{"city": "Oslo"}')]  # type: ignore[index]
    assert p.parse('<tool_call>{"name": "now"}</tool_call>') == ("", [ParsedCall("now", "{}")])
    for not_calls in ["plain text", call[:-3], call + " and more", "<tool_call>{oops}</tool_call>",
                      '<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": "a", "arguments": [1]}</tool_call>']:  # fmt: skip
        assert p.parse(not_calls) is None, not_calls
    assert p.content_end("Hello") == 5
    assert p.content_end("Hello <tool") == 6  # a start tag may be coming: held
    assert p.content_end("Hello <b>") == 9
    assert p.content_end("Hello <tool_call>{") == 6


def test_llama3_json_calls() -> None:
    p = Llama3JsonParser()
    assert p.parse('{"name": "weather", "parameters": {"city": "Oslo"}}') == (
        "",
        [ParsedCall("weather", '{"city": "Oslo"}')],
    )
    assert p.parse('<|python_tag|>{"name": "now", "parameters": {}}; {"name": "now", "arguments": {}}') == (
        "",
        [ParsedCall("now", "{}"), ParsedCall("now", "{}")],
    )
    for not_calls in ["The weather is fine.", '{"name": "now", "parameters": {}} and text', '{"name": "now"',
                      '{"city": "Oslo"}', '{"name": "a", "parameters": 5}']:  # fmt: skip
        assert p.parse(not_calls) is None, not_calls
    assert p.content_end("  {") == 0 and p.content_end("") == 0 and p.content_end("<|py") == 0
    assert p.content_end("Sure") == 4


def test_granite_calls() -> None:
    """Granite 3: the whole answer is a JSON array of calls, after <|tool_call|> (3.0), <tool_call>
    (3.1 and up) or neither; anything else is content, whole."""
    p = GraniteParser()
    weather = ParsedCall("weather", '{"city": "Oslo"}')
    array = '[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "now"}]'
    for text in (
        array,
        "<|tool_call|>" + array,
        " <tool_call> " + array + "\n",
        "<|tool_call|><tool_call>" + array,
    ):
        assert p.parse(text) == ("", [weather, ParsedCall("now", "{}")]), text
    for not_calls in ["The weather is fine.", "Sure: " + array, array + " and text", "<|tool_call|>", "[]",
                      "<|tool_call|>[{", '[{"city": "Oslo"}]', '[{"name": "a", "arguments": [1]}]']:  # fmt: skip
        assert p.parse(not_calls) is None, not_calls
    for held in ("", " ", "<|tool", "<|tool_call|>", "<|tool_call|> <tool", "[", "<tool_call>[{"):
        assert p.content_end(held) == 0, held
    assert p.content_end("Sure") == 4 and p.content_end("<|tool_call|>Sure") == len("<|tool_call|>Sure")
    assert not p.skip_special_tokens


def test_phi4_mini_calls() -> None:
    """Phi-4-mini: functools[...], a JSON array of calls (arguments or parameters), after any text."""
    p = Phi4MiniJsonParser()
    assert p.parse(
        'functools[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
    ) == (
        "",
        [ParsedCall("weather", '{"city": "Oslo"}'), ParsedCall("now", "{}")],
    )
    nested = 'functools[{"name": "sum", "arguments": {"xs": [1, [2]]}}]'
    assert p.parse("Let me add. " + nested) == ("Let me add. ", [ParsedCall("sum", '{"xs": [1, [2]]}')])
    for not_calls in ["The weather is fine.", "functools", 'functools[{"name": "now"}] and more',
                      'functools[{"name": "now"', "functools[]", "import functools"]:  # fmt: skip
        assert p.parse(not_calls) is None, not_calls
    assert p.content_end("Sure functools[{") == 5 and p.content_end("Sure functo") == 5
    assert p.content_end("Sure") == 4


def test_mistral_calls() -> None:
    """Both of Mistral's formats after [TOOL_CALLS]: a JSON array, and name[ARGS]{...} per call;
    the text before is content; nine-character ids of letters and digits."""
    p = MistralParser()
    weather = ParsedCall("weather", '{"city": "Oslo"}')
    assert p.parse('[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "now"}]') == (
        "",
        [weather, ParsedCall("now", "{}")],
    )
    assert p.parse('Let me look.[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]now[ARGS]{}') == (
        "Let me look.",
        [weather, ParsedCall("now", "{}")],
    )
    for not_calls in ["The weather is fine.", "[TOOL_CALLS]", '[TOOL_CALLS][{"name": "now"}] and text',
                      '[TOOL_CALLS][{"name": "now"', "[TOOL_CALLS][]", '[TOOL_CALLS]now{"a": 1}',
                      "[TOOL_CALLS]now[ARGS]{", '[TOOL_CALLS][ARGS]{}', '[TOOL_CALLS]now[ARGS]{} more',
                      '[TOOL_CALLS]now[ARGS]5', '[TOOL_CALLS][{"name": "a", "arguments": [1]}]']:  # fmt: skip
        assert p.parse(not_calls) is None, not_calls
    assert p.content_end("Sure [TOOL_CALLS]now") == 5 and p.content_end("Sure [TOOL") == 5
    assert p.content_end("Sure") == 4
    ids = {p.call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    assert ToolPlan("auto", parser=p).split("[TOOL_CALLS]now[ARGS]{}")[1][0].id.isalnum()  # type: ignore[index]


def test_auto_without_parallel_calls_returns_the_first_one() -> None:
    """parallel_tool_calls false cannot hold free text to one call: the first comes back (vLLM's
    answer), streamed or not; the content before it stays."""
    text = 'Sure <tool_call>{"name": "now"}</tool_call><tool_call>{"name": "weather", "arguments": {}}</tool_call>'
    single = tool_plan(request(tools=[NOW, WEATHER], parallel_tool_calls=False), HermesParser())
    content, calls = single.message(text)
    assert content == "Sure " and [c.function.name for c in calls or []] == ["now"]
    assert [
        c.function.name for c in tool_plan(request(tools=[NOW, WEATHER]), HermesParser()).split(text)[1] or []
    ] == [
        "now",
        "weather",
    ]
    deltas, reason = feed(single, [text[:20], text[20:]])
    assert [call["function"]["name"] for d in deltas for call in d.get("tool_calls") or []] == ["now"]
    assert reason == "tool_calls"


def test_special_tokens_are_kept_where_the_format_needs_them() -> None:
    """auto with a format whose markers may be special tokens detokenizes with them; any other
    plan keeps what the request asked."""
    assert ToolPlan("auto", parser=MistralParser()).skip_special_tokens(True) is False
    assert ToolPlan("auto", parser=HermesParser()).skip_special_tokens(True) is False
    assert ToolPlan("auto", parser=Llama3JsonParser()).skip_special_tokens(True) is True
    assert ToolPlan("none", parser=MistralParser()).skip_special_tokens(True) is True
    assert ToolPlan("named", function="now", parser=MistralParser()).skip_special_tokens(False) is False
    named = ToolPlan("named", function="now", parser=MistralParser()).split("{}")[1]
    assert named is not None and len(named[0].id) == 9  # the family's ids in every mode
    assert ToolPlan("named", function="now").split("{}")[1][0].id.startswith("call_")  # type: ignore[index]


def feed(plan: ToolPlan, pieces: list[str], finish: str = "stop") -> tuple[list[dict[str, Any]], str | None]:
    stream = ChoiceStream(0, plan)
    deltas: list[dict[str, Any]] = []
    reason = None
    for i, piece in enumerate(pieces):
        got, reason = stream.feed(piece, None, finish if i == len(pieces) - 1 else None)
        deltas += [d["delta"] for d in got]
    return deltas, reason


def test_streamed_choices() -> None:
    assert feed(ToolPlan("none"), ["a", "b"]) == ([{"content": "a"}, {"content": "b"}], "stop")
    named, reason = feed(ToolPlan("named", function="now"), ["{", "}"])
    assert named[0]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{"}
    assert named[0]["tool_calls"][0]["id"].startswith("call_") and reason == "stop"
    assert named[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    required, reason = feed(ToolPlan("required"), ['[{"name": "now", ', '"parameters": {}}]'])
    assert reason == "tool_calls" and len(required) == 1
    assert required[0]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    assert ToolPlan("required").message('[{"nom": "now"}]') == ('[{"nom": "now"}]', None)  # not the shape
    assert ToolPlan("required").message("5") == ("5", None)
    cut, reason = feed(ToolPlan("required"), ['[{"name": "now", '], "length")
    assert cut == [{"content": '[{"name": "now", '}] and reason == "length"
    auto = ToolPlan("auto", parser=HermesParser())
    deltas, reason = feed(auto, ["Sure <to", "ol_call>", '{"name": "now", "arguments": {}}', "</tool_call>"])
    assert deltas[0] == {"content": "Sure "} and reason == "tool_calls"
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    deltas, reason = feed(auto, ["a <to", "y> b"])
    assert "".join(d["content"] for d in deltas) == "a <toy> b" and reason == "stop"
    deltas, reason = feed(auto, ["a <tool_call>{", '"name"'], "length")  # cut short: all content
    assert "".join(d["content"] for d in deltas) == 'a <tool_call>{"name"' and reason == "length"
    message = auto.message("Sure " + '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    assert (
        message[0] == "Sure "
        and message[1] is not None
        and json.loads(message[1][0].function.arguments) == {}
    )
    assert auto.message('<tool_call>{"name": "now"}</tool_call>')[0] is None


def test_streamed_token_ids_go_with_the_next_delta_once() -> None:
    """vLLM's return_token_ids on a streamed chat: a piece's token ids go with the first delta sent
    after it (held text holds them too), each id once, in order; unasked, deltas carry none."""
    pieces = ["Sure <to", "ol_call>", '{"name": "now", "arguments": {}}', "</tool_call>"]
    for plan in (
        ToolPlan("none"),
        ToolPlan("named", function="now"),
        ToolPlan("auto", parser=HermesParser()),
    ):
        stream = ChoiceStream(0, plan, token_ids=True)
        sent: list[list[int]] = []
        for i, piece in enumerate(pieces):
            got, _ = stream.feed(piece, None, "stop" if i == len(pieces) - 1 else None, [10 * i, 10 * i + 1])
            sent += [d["token_ids"] for d in got]
        assert [t for ids in sent for t in ids] == [0, 1, 10, 11, 20, 21, 30, 31], plan.mode
        if plan.mode == "auto":  # "Sure " went out at once, the held call at the end with the rest
            assert sent[0] == [0, 1] and sent[-1] == [10, 11, 20, 21, 30, 31]
    silent = ChoiceStream(0, ToolPlan("none")).feed("a", None, None, [5])[0]
    assert "token_ids" not in silent[0]
    held = ChoiceStream(0, ToolPlan("none"), token_ids=True)
    assert held.feed("", None, None, [5])[0][0]["token_ids"] == [5]  # no text yet (half a character): ids


def test_pythonic_calls() -> None:
    """vLLM's pythonic format (Llama 3.2 and 4): the whole answer a Python list of calls with
    literal keyword arguments, read with ast and never run; anything else is content."""
    p = PythonicParser()
    assert p.parse('[weather(city="Oslo", days=2, units=None, hourly=True), now()]') == (
        "",
        [
            ParsedCall("weather", '{"city": "Oslo", "days": 2, "units": null, "hourly": true}'),
            ParsedCall("now", "{}"),
        ],
    )
    assert p.parse("<|python_start|>[find(tags=['moon', \"rabbit\"], near={'lat': -1.5})]<|python_end|>") == (
        "",
        [ParsedCall("find", '{"tags": ["moon", "rabbit"], "near": {"lat": -1.5}}')],
    )
    for not_calls in ["The weather is fine.", "[1, 2]", "[]", "[weather('Oslo')]", "[weather(city=x)]",
                      "[os.system(cmd='ls')]", "[f(**kw)]", "[f(a={1, 2})]", "[weather(city='Oslo')] and text",
                      "[weather(city='Oslo'", "[f(a=__import__('os'))]"]:  # fmt: skip
        assert p.parse(not_calls) is None, not_calls
    assert p.content_end("  [") == 0 and p.content_end("") == 0 and p.content_end("<|python") == 0
    assert p.content_end("Sure") == 4
    deltas, reason = feed(ToolPlan("auto", parser=p), ["[now", "()]"])
    assert reason == "tool_calls" and deltas[0]["tool_calls"][0]["function"] == {
        "name": "now",
        "arguments": "{}",
    }
    deltas, reason = feed(ToolPlan("auto", parser=p), ["It is ", "[late]"])
    assert "".join(d["content"] for d in deltas) == "It is [late]" and reason == "stop"


def test_qwen3_coder_calls() -> None:
    """vLLM's qwen3_coder format: XML-like calls after any text, each value read as the type its
    parameter's schema names (text where it does not read so, or the schema names none)."""
    from services.gateway.schemas import ToolSpec

    p = Qwen3CoderParser()
    find = ToolSpec.model_validate({"type": "function", "function": {"name": "find", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "near": {"type": "object"},
            "km": {"type": "number"}, "hourly": {"type": "boolean"}, "tags": {"type": ["array", "null"]},
            "when": {"type": "integer"}}}}})  # fmt: skip
    text = (
        "Let me look.\n<tool_call>\n<function=find>\n<parameter=city>\n42\n</parameter>\n"
        '<parameter=days>\n2\n</parameter>\n<parameter=near>\n{"lat": -1.5}\n</parameter>\n'
        "<parameter=km>\n3.0\n</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n"
        "<parameter=tags>\n['moon', 'rabbit']\n</parameter>\n<parameter=when>\nsoon\n</parameter>\n"
        "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>\n"
        "<function=now>\n</function>"
    )
    content, calls = p.parse(text, [find]) or ("", [])
    assert content == "Let me look.\n"
    assert [c.name for c in calls] == ["find", "now"] and json.loads(calls[1].arguments) == {}
    assert json.loads(calls[0].arguments) == {
        "city": "42", "days": 2, "near": {"lat": -1.5}, "km": 3, "hourly": True, "tags": ["moon", "rabbit"],
        "when": "soon", "extra": "7",
    }  # fmt: skip
    unknown = p.parse("<function=find><parameter=days>\n2\n</parameter></function>")  # no tools: text
    assert unknown == ("", [ParsedCall("find", '{"days": "2"}')])
    assert p.parse("<function=x><parameter=v>\nnull\n</parameter></function>") == (
        "", [ParsedCall("x", '{"v": null}')]
    )  # fmt: skip
    for not_calls in ["No call here.", "<function=find><parameter=days>\n2\n</parameter>",  # cut short
                      "<tool_call><function=find></function></tool_call> and after",
                      "<function=find>stray text</function>"]:  # fmt: skip
        assert p.parse(not_calls, [find]) is None, not_calls
    assert p.content_end("Sure <tool") == 5 and p.content_end("Sure <func") == 5
    assert p.content_end("Sure <function=x>") == 5 and p.content_end("Sure") == 4
    plan = ToolPlan("auto", parser=p, tools=(find,))
    deltas, reason = feed(plan, ["Sure ", "<tool_call><function=find><parameter=days>\n", "3\n</parameter>",
                                 "</function></tool_call>"])  # fmt: skip
    assert reason == "tool_calls" and deltas[0]["content"] == "Sure "
    (call,) = deltas[-1]["tool_calls"]
    assert call["function"] == {"name": "find", "arguments": '{"days": 3}'}
    from_request = tool_plan(request(tools=[WEATHER, NOW]), p)  # auto: the request's tools reach the parser
    assert [t.function.name for t in from_request.tools] == ["weather", "now"]
