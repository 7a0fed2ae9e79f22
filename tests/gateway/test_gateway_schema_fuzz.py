"""Schemathesis against the gateway's own /openapi.json: no 5xx, every error in the OpenAI envelope, and
every answer documented (status code, content type, JSON body schema).

The schema is loaded from the running gateway of ``stack``. Generated bodies get ``model`` set to
the served model (so requests reach generation) and n / max_tokens kept small (so generation is
quick); everything else is as schemathesis makes it, valid and invalid. Runs are derandomized, so
a failure reproduces; about 80 cases per operation (~6-60 s per operation on a 2-core machine).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest
import schemathesis
from gateway_support import MODEL_NAME, Stack
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

MAX_N, MAX_TOKENS = 4, 4
ENVELOPE_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def gateway_schema(stack: Stack) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json")
    schema.config.update(base_url=stack.base_url)

    @schema.hook("map_case")
    def served_model_small_outputs(
        context: schemathesis.HookContext, case: schemathesis.Case
    ) -> schemathesis.Case:
        body = case.body
        if not isinstance(body, dict):
            return case  # a negative case that is not even an object
        negative = case.meta is not None and case.meta.generation.mode is GenerationMode.NEGATIVE
        # A negative case keeps what makes it invalid: only fields that are already of a valid type
        # are changed (any string is a valid model name; a smaller int keeps n / max_tokens valid).
        if not negative or isinstance(body.get("model"), str):
            body["model"] = MODEL_NAME
        if _is_int(body.get("n")) and body["n"] > MAX_N:
            body["n"] = MAX_N
        for key in ("max_tokens", "max_completion_tokens"):
            if _is_int(body.get(key)) and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if negative:
            return case
        if "messages" in body and body.get("max_tokens", body.get("max_completion_tokens")) is None:
            body["max_tokens"] = MAX_TOKENS  # a chat without one would run to the end of the context
        if "stream" not in body and "completions" in case.operation.path and _digest(body) % 2:
            body["stream"] = True  # schemathesis seldom sets it: stream half the others (SSE is checked too)
        return case

    return schema


@schemathesis.check
def openai_error_envelope(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """Every non-2xx body is {"error": {"message", "type", "param", "code"}} with a message and a type."""
    if response.status_code < 300:
        return None
    body = response.json()
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)):
        raise AssertionError(f"{response.status_code} without the OpenAI envelope: {response.text[:300]}")
    error = body["error"]
    if set(error) != ENVELOPE_FIELDS:
        raise AssertionError(f"envelope fields {sorted(error)}, expected {sorted(ENVELOPE_FIELDS)}")
    if not (isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)):
        raise AssertionError(f"envelope without a message or type: {error}")
    return None


def _digest(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


CHECKS = [
    not_a_server_error,
    openai_error_envelope,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]

GENERATION_ROUTES = r"^/(v1/completions|v1/chat/completions|tokenize|detokenize)$"
schema = schemathesis.pytest.from_fixture("gateway_schema").include(path_regex=GENERATION_ROUTES)


@schema.parametrize()
@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_gateway_answers_only_what_it_documents(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=CHECKS, timeout=60)
