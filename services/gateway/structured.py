"""Structured outputs at the HTTP edge: a request's output constraint, as one llguidance grammar.

Accepted, one per request (two are a 400 naming the second):

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
- vLLM's ``structured_outputs``: one of ``json`` (a schema, or its JSON text), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (Lark or GBNF), ``json_object: true``;
- vLLM's older extras ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- on chat completions, a ``tool_choice`` that asks for tool calls (services/gateway/tools.py).

JSON output may take vLLM's whitespace options: ``structured_outputs.whitespace_pattern`` (or the
older ``guided_whitespace_pattern``), the regex of the whitespace allowed between JSON tokens, and
``structured_outputs.disable_any_whitespace`` (true, the default here: compact; false: JSON's own
whitespace anywhere).

Each is compiled here (:func:`yutu.engine.structured.grammar_from`) so a schema, regex or grammar
that does not compile is a 400 naming its field before any worker sees it; the workers get the
compiled grammar (``SamplingParams.grammar``) and mask every token with it. JSON comes out compact
(no whitespace beyond ", " and ": "), and a schema's keys in its ``properties`` order. Compiled
grammars are cached by their spec's text; one the cache lacks compiles on the tokenizer pool's
threads (it releases the GIL: ~30 ms for 60 KB of schema, ~0.4 s for 600 KB), not on the event loop
that streams every other response.
"""

from __future__ import annotations

import json
from typing import Any

from yutu.engine.structured import ANY_WHITESPACE, GrammarKind, LRUCache, grammar_from

from services.gateway.errors import invalid
from services.gateway.schemas import _GenerationRequest
from services.gateway.tokenization import PromptTokenizer

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
COMPILED_CACHE_SIZE = 256  # compiled grammars the gateway keeps, by their spec's text
COMPILED_CACHE_BYTES = 32 * 2**20  # ... of at most this much text, specs and grammars (a spec may be MBs)
_STRUCTURED_OUTPUTS_KEYS: dict[str, GrammarKind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
_GUIDED: dict[str, GrammarKind] = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _response_format(value: dict[str, Any]) -> tuple[GrammarKind, Any] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", ANY_JSON_OBJECT
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid(
                'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., "schema": {...}}',
                "response_format",
            )
        return "json_schema", spec["schema"]
    raise invalid(
        f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format"
    )


_WHITESPACE_KEYS = {"whitespace_pattern", "disable_any_whitespace"}


def _structured_outputs(value: dict[str, Any]) -> list[tuple[str, GrammarKind, Any]]:
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KEYS) - {"json_object"} - _WHITESPACE_KEYS)
    if unknown:
        raise invalid(
            f"structured_outputs takes json, regex, choice, grammar or json_object (and whitespace_pattern,"
            f" disable_any_whitespace); {', '.join(unknown)} is not supported",
            "structured_outputs",
        )
    found: list[tuple[str, GrammarKind, Any]] = [
        (f"structured_outputs.{key}", kind, value[key])
        for key, kind in _STRUCTURED_OUTPUTS_KEYS.items()
        if value.get(key) is not None
    ]
    if value.get("json_object") is True:
        found.append(("structured_outputs.json_object", "json_schema", ANY_JSON_OBJECT))
    elif value.get("json_object") not in (None, False):
        raise invalid("structured_outputs.json_object must be a boolean", "structured_outputs")
    return found


async def grammar_for(
    req: _GenerationRequest, pool: PromptTokenizer, tool_schema: dict[str, Any] | None = None
) -> str | None:
    """The compiled grammar the request's output must follow, or None; 400 naming the field when
    the constraint is malformed, does not compile, or comes with another one. ``tool_schema``: the
    schema its ``tool_choice`` puts on the output (services/gateway/tools.py), one constraint too.
    A grammar not in the cache compiles on ``pool``'s threads."""
    found: list[tuple[str, GrammarKind, Any]] = []
    if tool_schema is not None:
        found.append(("tool_choice", "json_schema", tool_schema))
    if req.response_format is not None and (spec := _response_format(req.response_format)) is not None:
        found.append(("response_format", *spec))
    if req.structured_outputs is not None:
        found += _structured_outputs(req.structured_outputs)
    found += [
        (name, kind, getattr(req, name)) for name, kind in _GUIDED.items() if getattr(req, name) is not None
    ]
    whitespace = _whitespace(req)
    if not found:
        if whitespace is not None:
            raise invalid(
                "a whitespace option needs JSON output: a schema or any JSON object", "structured_outputs"
            )
        return None
    if len(found) > 1:
        raise invalid(
            f"give one output constraint: {found[0][0]} and {found[1][0]} are both set",
            found[1][0].split(".")[0],
        )
    param, kind, spec = found[0]
    if kind in ("regex", "grammar") and not isinstance(spec, str):
        raise invalid(f"{param} must be a string, got {type(spec).__name__}", param.split(".")[0])
    key = (kind, spec if isinstance(spec, str) and kind != "choice" else json.dumps(spec), whitespace)
    grammar = _compiled.get(key)
    if grammar is None:
        try:
            grammar = await pool.off_loop(_compile, *key)
        except ValueError as exc:
            raise invalid(f"{param}: {exc}", param.split(".")[0]) from None
        _compiled.put(key, grammar)
    return grammar


def _whitespace(req: _GenerationRequest) -> str | None:
    """The whitespace pattern JSON output is compiled with (None: compact), from vLLM's options."""
    options = req.structured_outputs or {}
    pattern = options.get("whitespace_pattern", req.guided_whitespace_pattern)
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise invalid("whitespace_pattern must be a non-empty regex string", "structured_outputs")
    disable = options.get("disable_any_whitespace", True)
    if not isinstance(disable, bool):
        raise invalid("structured_outputs.disable_any_whitespace must be a boolean", "structured_outputs")
    if pattern is not None and not disable:
        raise invalid(
            "give whitespace_pattern or disable_any_whitespace: false, not both", "structured_outputs"
        )
    return ANY_WHITESPACE if not disable else pattern


# Compiled grammars by (kind, the spec as text, the whitespace pattern): clients tend to send one
# schema again and again. A spec that does not compile is not kept (it raises every time). Used on
# the event loop only.
_compiled: LRUCache[tuple[GrammarKind, str, str | None], str] = LRUCache(
    COMPILED_CACHE_SIZE, COMPILED_CACHE_BYTES, lambda key, grammar: len(key[1]) + len(grammar)
)


def _compile(kind: GrammarKind, text: str, whitespace: str | None) -> str:
    """``grammar_from`` of a spec given as text (a schema or a list of choices as JSON)."""
    return grammar_from(kind, json.loads(text) if kind == "choice" else text, whitespace)
