"""KV reuse across instances through the store, and conditional disaggregation.

With two prefill instances and round_robin, a request that shares all but the last block of an
earlier 1024-token prompt lands on the *other* prefill instance, which fetches the shared blocks
from the KV store (written behind the first request) instead of computing them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.disagg.disagg_support import BLOCK_SIZE, DisaggStack, prompt


@pytest.fixture(scope="module")
def two_prefills(
    tmp_path_factory: pytest.TempPathFactory, long_model: Path, redis_url: str
) -> Iterator[DisaggStack]:
    with DisaggStack(
        tmp_path_factory.mktemp("reuse"), long_model, redis_url, prefill=2, decode=1, policy="round_robin"
    ) as s:
        yield s


def store_objects(stack: DisaggStack) -> int:
    stats = httpx.get(stack.admin("store-master", "store-master") + "/stats", timeout=10).json()
    return int(stats["objects"])


def test_a_prefix_computed_on_one_prefill_is_fetched_by_the_other(two_prefills: DisaggStack) -> None:
    s = two_prefills
    a = prompt(1024, seed=7)
    b = a[: 1024 - BLOCK_SIZE] + prompt(BLOCK_SIZE, seed=8)
    first = s.complete(a, max_tokens=4)
    assert first.status == 200 and first.cached == 0
    # Write-behind puts A's 64 blocks into the store behind the request: wait until they are in.
    s.wait_for(lambda: store_objects(s) >= 1024 // BLOCK_SIZE, 30, "A's blocks in the store")
    second = s.complete(b, max_tokens=6)
    assert second.status == 200
    assert second.headers["x-yutu-prefill"] != first.headers["x-yutu-prefill"]  # round_robin: the other one
    assert second.cached >= 1024 - BLOCK_SIZE
    fetched = sum(
        s.get("prefill", p, "/info")["imports"]["fetched_blocks"] for p in ("prefill-0", "prefill-1")
    )
    assert fetched >= (1024 - BLOCK_SIZE) // BLOCK_SIZE
    # The cold run of B, on a stack that never saw A, gives the same tokens.
    reference = s.reference(b, max_tokens=6)
    assert second.tokens == reference


def test_a_cache_salt_keeps_tenants_apart_across_instances_and_the_store(two_prefills: DisaggStack) -> None:
    """vLLM's ``cache_salt`` on the disaggregated path: a prompt prefilled under one salt (on one
    prefill instance, written behind to the store) is reused by the same salt -- on the other
    prefill instance, from the store -- and by no other salt, nor by an unsalted request."""
    s = two_prefills
    a = prompt(512, seed=21)
    b = a[: 512 - BLOCK_SIZE] + prompt(BLOCK_SIZE, seed=22)
    before = store_objects(s)
    first = s.complete(a, max_tokens=4, cache_salt="tenant-a")
    assert first.status == 200 and first.cached == 0
    s.wait_for(lambda: store_objects(s) >= before + 512 // BLOCK_SIZE, 30, "A's salted blocks in the store")
    reference = s.reference(b, max_tokens=4)
    for salt in ("tenant-b", None):  # on either prefill instance: nothing of A's is theirs
        extra = {} if salt is None else {"cache_salt": salt}
        other = s.complete(b, max_tokens=4, **extra)
        assert other.status == 200 and other.cached == 0 and other.tokens == reference, (salt, other.body)
    same = s.complete(b, max_tokens=4, cache_salt="tenant-a")
    assert same.status == 200 and same.cached >= 512 - BLOCK_SIZE and same.tokens == reference


def test_conditional_disaggregation_prefills_short_remainders_on_the_decode(
    tmp_path: Path, long_model: Path, redis_url: str
) -> None:
    with DisaggStack(tmp_path, long_model, redis_url, disagg_threshold=64) as s:
        short = s.complete(prompt(40, seed=1), max_tokens=4)
        assert short.headers["x-yutu-prefill"] == "none" and short.headers["x-yutu-decode"] == "decode-0"
        long = prompt(300, seed=2)
        handed = s.complete(long, max_tokens=4)
        assert handed.headers["x-yutu-prefill"] == "prefill-0"
        # The decode now holds the long prompt's blocks (pulled): a follow-up adding 20 tokens
        # leaves a remainder under the threshold, so the decode prefills it itself.
        follow = s.complete(long + prompt(20, seed=3), max_tokens=4)
        assert follow.headers["x-yutu-prefill"] == "none"
        assert follow.cached >= 288
        assert short.tokens == s.reference(prompt(40, seed=1), 4)
        assert follow.tokens == s.reference(long + prompt(20, seed=3), 4)
