"""Token-id prompts are checked in bulk: the bulk checks against plain per-item references.

A prompt of token ids is thousands of JSON numbers; the gateway's request checks (integral floats,
lone surrogates, the vocabulary range) look at such a list once instead of calling Python per id.
Each check here is compared with the per-item version it replaced, on random JSON-like values.
"""

from __future__ import annotations

import random
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from services.gateway.errors import ApiError
from services.gateway.prompts import check_token_ids, is_token_ids
from services.gateway.schemas import CompletionRequest, TokenIds, _integral
from services.gateway.valid_text import first_invalid_text, lone_surrogate


def reference_invalid_text(value: Any, path: str = "") -> tuple[str, int, str] | None:
    """The per-item walk (every list item visited, its path formatted)."""
    if isinstance(value, str):
        at = lone_surrogate(value)
        return None if at is None else (path or "body", at, value[at])
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and (at := lone_surrogate(key)) is not None:
                return (path or "body", at, key[at])
            found = reference_invalid_text(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = reference_invalid_text(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["int", "float", "bool", "none", "str", "bad", "list", "ids", "dict"])
    if depth > 3 and kind in ("list", "ids", "dict"):
        kind = "int"
    if kind == "int":
        return rng.randrange(-5, 9000)
    if kind == "float":
        return rng.choice([2.0, 0.5, -1.0])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "str":
        return rng.choice(["", "ok", "héllo", "😀"])
    if kind == "bad":
        return rng.choice(["\ud800", "a\udfffb", "x\ud83d"])
    if kind == "ids":
        return [rng.randrange(0, 9000) for _ in range(rng.randrange(0, 40))]
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {
        rng.choice(["a", "b", "\ud800k", "c"]): random_json(rng, depth + 1)
        for _ in range(rng.randrange(0, 4))
    }


def test_the_text_check_finds_what_the_per_item_walk_finds() -> None:
    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        value = {"prompt": random_json(rng), "stop": random_json(rng)}
        expected = reference_invalid_text(value)
        assert first_invalid_text(value) == expected, value
        found += expected is not None
    assert 300 < found < 2700  # both outcomes were exercised


def test_the_text_check_names_the_item_after_token_ids() -> None:
    assert first_invalid_text({"prompt": list(range(5000))}) is None
    assert first_invalid_text({"prompt": [[1, 2], [3, 4.0, True, None], "a\udfffb"]}) == (
        "prompt.2",
        1,
        "\udfff",
    )
    assert first_invalid_text([7, 8, {"k": ["ok", "\ud800"]}]) == ("2.k.1", 0, "\ud800")


class PerItem(BaseModel):
    """The prompt and stop_token_ids types before the bulk validator: a validator per id."""

    model_config = ConfigDict(strict=True)
    ids: list[Annotated[int, BeforeValidator(_integral)]] | None = None
    nested: list[list[Annotated[int, BeforeValidator(_integral)]]] | None = None


class Bulk(BaseModel):
    model_config = ConfigDict(strict=True)
    ids: TokenIds | None = None
    nested: list[TokenIds] | None = None


def outcome(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data).model_dump()
    except ValidationError as exc:
        return [(e["loc"], e["type"]) for e in exc.errors()]


@pytest.mark.parametrize("seed", range(4))
def test_bulk_token_ids_validate_as_a_validator_per_id(seed: int) -> None:
    rng = random.Random(seed)
    items = [0, 5, 8191, -1, 2.0, 3.0, 2.5, True, "7", None, 10**20]
    for _ in range(500):
        ids = [
            rng.choice(items) if rng.random() < 0.2 else rng.randrange(0, 9000)
            for _ in range(rng.randrange(0, 30))
        ]
        data = {"ids": ids, "nested": [ids, ids[: len(ids) // 2]]}
        assert outcome(Bulk, data) == outcome(PerItem, data), data


def test_a_completion_prompt_of_integral_floats_is_token_ids() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": [1.0, 2, 3.0], "stop_token_ids": [4.0]})
    assert req.prompt == [1, 2, 3] and all(type(t) is int for t in req.prompt)
    assert req.stop_token_ids == [4]
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": [1, 2.5]})
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1.0], [2]]}).prompt == [[1], [2]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]}).prompt == ["a", "b"]


def test_token_id_checks() -> None:
    assert is_token_ids([]) and is_token_ids([1, 2, 3])
    assert not is_token_ids([1, True]) and not is_token_ids([[1]]) and not is_token_ids("12")
    check_token_ids([], 10, "prompt")
    check_token_ids([0, 9, 5], 10, "prompt")
    for bad in ([0, 10], [-1, 3], [3, 11, -2, 4]):
        with pytest.raises(ApiError) as err:
            check_token_ids(bad, 10, "prompt")
        assert str([t for t in bad if not 0 <= t < 10]) in str(err.value.message)
