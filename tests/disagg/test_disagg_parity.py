"""Disaggregated serving gives the mixed worker's output, token for token.

One stack with a mixed worker and one with a prefill and a decode instance (conditional
disaggregation off, so every request is handed over), same tiny model, 8 concurrent greedy
requests of mixed lengths, streamed and not: the same tokens, logprobs within 1e-5, and every
disaggregated response names the prefill and the decode instance that served it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from yutu.engine.structured import grammar_from

from tests.disagg.disagg_support import MODEL_NAME, DisaggStack, Reply, prompt

LENGTHS = [5, 16, 17, 40, 100, 160, 255, 400]  # one token, exact blocks, a token past, long ones


@pytest.fixture(scope="module")
def mixed(
    tmp_path_factory: pytest.TempPathFactory, long_model: Path, redis_url: str
) -> Iterator[DisaggStack]:
    with DisaggStack(
        tmp_path_factory.mktemp("mixed"),
        long_model,
        redis_url,
        prefill=0,
        decode=0,
        mixed=1,
        store=False,
        conductor=False,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def disagg(
    tmp_path_factory: pytest.TempPathFactory, long_model: Path, redis_url: str
) -> Iterator[DisaggStack]:
    with DisaggStack(tmp_path_factory.mktemp("disagg"), long_model, redis_url, disagg_threshold=0) as s:
        yield s


def run_all(stack: DisaggStack, stream: bool) -> list[Reply]:
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        futures = [pool.submit(stack.complete, prompt(n, seed=n), 24, stream) for n in LENGTHS]
        return [f.result() for f in futures]


@pytest.mark.parametrize("stream", [False, True])
def test_disaggregated_output_equals_the_mixed_worker(
    mixed: DisaggStack, disagg: DisaggStack, stream: bool
) -> None:
    want = run_all(mixed, stream)
    got = run_all(disagg, stream)
    for n, w, g in zip(LENGTHS, want, got, strict=True):
        assert w.status == g.status == 200, (n, w.body, g.body)
        assert len(g.tokens) == 24 and g.tokens == w.tokens, f"prompt of {n} tokens"
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
        assert g.text == w.text
        assert g.headers["x-yutu-prefill"] == "prefill-0" and g.headers["x-yutu-decode"] == "decode-0"
        assert w.headers["x-yutu-prefill"] == "none" and w.headers["x-yutu-decode"] == "worker-0"
        assert g.headers["x-request-id"]
    decode_info = disagg.get("decode", "decode-0", "/info")
    assert decode_info["imports"]["pulled_blocks"] > 0  # the KV came from the prefill, by transfer
    # The prompt blocks the decode pulled are the prefill instance's to write behind: none was put
    # into the store a second time (they are known; only the blocks the decode computed are written).
    behind = decode_info["write_behind"]
    assert behind["already_stored"] == 0 and behind["known"] > 0 and behind["written"] > 0, behind
    metrics = httpx.get(disagg.admin("decode", "decode-0") + "/metrics", timeout=10).text
    values = {
        line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line and line[0] != "#"
    }
    assert values["yutu_worker_kv_pulled_blocks_total"] == decode_info["imports"]["pulled_blocks"]
    assert values["yutu_worker_kv_import_bytes_total"] >= values["yutu_worker_kv_pulled_blocks_total"] * 1024
    assert values["yutu_worker_kv_import_seconds_total"] > 0
    assert disagg.get("prefill", "prefill-0", "/info")["holds"]["held"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_and_penalties_hold_across_the_handoff(
    mixed: DisaggStack, disagg: DisaggStack, stream: bool
) -> None:
    """The prefill instance samples the first token with the bias and the repetition penalty (the
    prompt's tokens), the decode instance goes on counting that token among the output's: the
    tokens of an engine running the request alone, on both stacks."""
    ids = prompt(70, seed=70)
    api = {"logit_bias": {"7": 3.0, "30": -1.5}, "repetition_penalty": 1.3, "frequency_penalty": 1.2,
           "presence_penalty": 0.5}  # fmt: skip
    want = disagg.reference(
        ids,
        20,
        logit_bias=((7, 3.0), (30, -1.5)),
        repetition_penalty=1.3,
        frequency_penalty=1.2,
        presence_penalty=0.5,
    )
    assert want != disagg.reference(ids, 20)
    for stack in (mixed, disagg):
        reply = stack.complete(ids, 20, stream, **api)
        assert reply.status == 200, reply.body
        assert reply.tokens == want
    assert reply.headers["x-yutu-prefill"] == "prefill-0" and reply.headers["x-yutu-decode"] == "decode-0"


def test_allowed_token_ids_and_bad_words_hold_across_the_handoff(
    mixed: DisaggStack, disagg: DisaggStack
) -> None:
    """The prefill instance samples the first token within ``allowed_token_ids``, the decode instance
    the rest; a bad word of two tokens whose first the prefill instance sampled is banned by the
    decode instance (it counts that token among the output's): an engine's tokens, on both stacks."""
    from yutu.engine.tokenizer import Tokenizer

    from services.gateway.prompts import bad_word_ids

    tok = Tokenizer.from_dir(disagg.model)
    for seed in range(
        60, 160
    ):  # a prompt whose first two greedy tokens are a word: text that encodes to them
        ids = prompt(60, seed=seed)
        plain = disagg.reference(ids, 16)
        word = tok.decode(plain[:2])
        if tuple(plain[:2]) in bad_word_ids([word], tok):
            break
    else:
        pytest.fail("no prompt of 100 starts its output with a word of two tokens")
    banned = disagg.reference(ids, 16, bad_words=bad_word_ids([word], tok))
    assert banned[0] == plain[0] and banned[1] != plain[1]  # the ban falls on the decode's first token
    allowed = sorted({*plain[1:4], 9, 11})
    want = disagg.reference(ids, 16, allowed_token_ids=tuple(allowed))
    assert want != plain and set(want) <= set(allowed)
    for stack in (mixed, disagg):
        reply = stack.complete(ids, 16, False, allowed_token_ids=allowed)
        assert reply.status == 200 and reply.tokens == want, reply.body
        reply = stack.complete(ids, 16, False, bad_words=[word])
        assert reply.status == 200 and reply.tokens == banned, reply.body
    assert reply.headers["x-yutu-prefill"] == "prefill-0" and reply.headers["x-yutu-decode"] == "decode-0"


def test_a_grammar_the_model_refuses_is_a_400_on_either_stack(
    mixed: DisaggStack, disagg: DisaggStack
) -> None:
    """The gateway passes ``<[99999]>`` (valid Lark: a token id), the engine that compiles it
    against the model's vocabulary refuses it, off its step: on the prefill instance as on the
    mixed worker, a 400 with the compiler's reason (not a failure to place elsewhere, not a 500)."""
    for stack in (mixed, disagg):
        reply = stack.complete(
            prompt(30, seed=30), 8, False, structured_outputs={"grammar": "start: <[99999]>"}
        )
        assert reply.status == 400, reply.body
        assert reply.body["error"]["type"] == "invalid_request_error"
        assert "does not compile" in reply.body["error"]["message"]
        assert stack.complete(prompt(30, seed=30), 8, False).status == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_holds_across_the_handoff(
    mixed: DisaggStack, disagg: DisaggStack, stream: bool
) -> None:
    """The prefill instance samples the first token under the schema; the decode instance rebuilds
    the request's matcher from that token and goes on: the tokens of an engine running it alone,
    on both stacks, a JSON document of the schema, ended with stop when complete."""
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
              "tag": {"enum": ["moon", "jade", "rabbit"]}}, "required": ["id", "tag"], "additionalProperties": False}  # fmt: skip
    ids = prompt(50, seed=50)
    want = disagg.reference(ids, 40, grammar=grammar_from("json_schema", schema))
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}
    for stack in (mixed, disagg):
        reply = stack.complete(ids, 40, stream, response_format=fmt)
        assert reply.status == 200, reply.body
        assert reply.tokens == want
        value = json.loads(reply.text)
        assert (
            set(value) == {"id", "tag"}
            and 0 <= value["id"] <= 999
            and value["tag"] in ("moon", "jade", "rabbit")
        )
        assert stream or reply.body["choices"][0]["finish_reason"] == "stop"
    assert len(want) < 40  # ended by the grammar, not by max_tokens
    # A grammar complete at its first token ends the request on the prefill instance.
    for stack in (mixed, disagg):
        reply = stack.complete(ids, 40, stream, guided_choice=["x"])
        assert reply.status == 200, reply.body
        assert reply.text == "x" and len(reply.tokens) == 1
        assert stream or reply.body["choices"][0]["finish_reason"] == "stop"
    assert reply.headers["x-yutu-prefill"] == "prefill-0" and reply.headers["x-yutu-decode"] == "decode-0"


@pytest.mark.parametrize("stream", [False, True])
def test_an_echoed_prompt_is_scored_whole_on_a_decode_instance(
    mixed: DisaggStack, disagg: DisaggStack, stream: bool
) -> None:
    """``echo`` with ``logprobs`` needs every prompt token's logits: the request skips the prefill
    instance and reused KV (twice the same prompt: nothing cached) and the decode instance
    computes it whole, with the mixed worker's tokens and logprobs."""
    ids = prompt(70, seed=71 + stream)
    want = mixed.complete(ids, 6, stream, echo=True, logprobs=1)
    assert want.status == 200, want.body
    assert want.tokens[:70] == ids and len(want.tokens) == 76 and want.logprobs[0] is None
    for _ in range(2):
        got = disagg.complete(ids, 6, stream, echo=True, logprobs=1)
        assert got.status == 200, got.body
        assert got.tokens == want.tokens and got.logprobs[0] is None
        assert got.logprobs[1:] == pytest.approx(want.logprobs[1:], abs=1e-5)
        assert got.headers["x-yutu-prefill"] == "none" and got.headers["x-yutu-decode"] == "decode-0"
        assert got.cached == 0


def test_the_decode_instance_is_told_while_the_prefill_runs_unless_the_first_token_is_the_last(
    disagg: DisaggStack,
) -> None:
    """A handed-over request is admitted on its decode instance while its prompt is prefilled
    (``await_kv``: its blocks taken, the pull started by KVReady); one whose first token is its last
    is not sent there at all."""
    before = disagg.get("decode", "decode-0", "/info")["imports"]
    ids = prompt(90, seed=7)
    two = disagg.complete(ids, max_tokens=6, stream=True)
    one = disagg.complete(prompt(91, seed=8), max_tokens=1)
    after = disagg.get("decode", "decode-0", "/info")["imports"]
    assert two.status == one.status == 200, (two.body, one.body)
    assert two.headers["x-yutu-prefill"] == one.headers["x-yutu-prefill"] == "prefill-0"
    assert two.tokens == disagg.reference(ids, 6) and len(one.tokens) == 1
    assert after["awaited"] - before["awaited"] == 1 and after["awaits_dropped"] == before["awaits_dropped"]
    assert after["pulled_blocks"] - before["pulled_blocks"] == -(-90 // 16)


def test_a_client_request_id_is_echoed(disagg: DisaggStack) -> None:
    resp = httpx.post(
        f"{disagg.url}/v1/completions",
        json={"model": "tiny", "prompt": prompt(20, 1), "max_tokens": 2},
        headers={"x-request-id": "my-trace-42"},
        timeout=60,
    )
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "my-trace-42"
    bad = httpx.post(f"{disagg.url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert bad.status_code == 404 and len(bad.headers["x-request-id"]) == 32  # errors carry one too


def test_requests_that_ended_stop_counting_on_their_instances_at_once(disagg: DisaggStack) -> None:
    # Requests of one or two tokens end between two load reports, so no report ever shows them
    # running; without the gateway's Finished they would count on the decode for the handoff TTL.
    for i in range(12):
        reply = disagg.complete(prompt(30 + i, seed=100 + i), max_tokens=1 + i % 2, stream=i % 3 == 0)
        assert reply.status == 200, reply.body
    deadline = time.monotonic() + 3.0  # well inside the conductor's 10 s handoff TTL
    while True:
        pending = {
            i["instance_id"]: i["pending"]
            for i in disagg.get("conductor", "conductor", "/instances")["instances"]
        }
        if not any(pending.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert pending == {"prefill-0": 0, "decode-0": 0}


def test_beam_search_finds_the_same_beams_disaggregated(mixed: DisaggStack, disagg: DisaggStack) -> None:
    """Beam search's rounds of one-token requests, each prefilled on the prefill instance and
    handed over, give the mixed worker's beams."""
    body = {"model": MODEL_NAME, "prompt": prompt(40, seed=41), "max_tokens": 5, "n": 3,
            "use_beam_search": True, "return_token_ids": True}  # fmt: skip
    replies = [httpx.post(f"{s.url}/v1/completions", json=body, timeout=120) for s in (mixed, disagg)]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    want, got = ([c["token_ids"] for c in r.json()["choices"]] for r in replies)
    assert got == want and len(got) == 3 and all(1 <= len(t) <= 5 for t in got)
