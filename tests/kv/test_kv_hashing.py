"""Block keys: pinned reference vectors and the chaining contract."""

from __future__ import annotations

import struct

import pytest
import xxhash
from yutu.kv.hashing import BLOCK_HASH_SEED, block_key_digests, block_keys, chain_key, root_key, salted_root

MODEL = "yutu-test"


def test_seed_is_pinned() -> None:
    assert BLOCK_HASH_SEED == 0x59757475


def test_reference_vectors() -> None:
    # Computed once and written here literally: any change renames every stored block.
    assert root_key(MODEL).hex() == "9296f932f6d8634a67b1929c1be2fa60"
    assert block_keys(MODEL, list(range(40)), 16) == [
        "fdc4a2db748d3f46eaa4c02fe42fe060",
        "f5efa64bfcf32f125545a5215acce696",
    ]
    assert block_keys(MODEL, [1, 2, 3, 4], 2) == [
        "e9d506e25a26c0ffa6c6fc9cb60d96b1",
        "b5b849dd83eba1b44715cbd1404e7abb",
    ]
    assert chain_key(bytes(16), [0, 1, 0xFFFFFFFF]).hex() == "52c9f11ff3ae0fe40b2d3bcdf66a5cd0"


def test_contract_spelled_out_with_xxhash() -> None:
    tokens = [7, 300, 65536, 1, 2, 3]
    k0 = xxhash.xxh3_128(MODEL.encode(), seed=BLOCK_HASH_SEED).digest()
    k1 = xxhash.xxh3_128(k0 + struct.pack("<3I", 7, 300, 65536), seed=BLOCK_HASH_SEED).digest()
    k2 = xxhash.xxh3_128(k1 + struct.pack("<3I", 1, 2, 3), seed=BLOCK_HASH_SEED).digest()
    assert k0 == root_key(MODEL)
    assert block_keys(MODEL, tokens, 3) == [k1.hex(), k2.hex()]
    assert len(k1) == 16


def test_full_blocks_only() -> None:
    assert block_keys(MODEL, list(range(15)), 16) == []
    assert len(block_keys(MODEL, list(range(47)), 16)) == 2
    assert block_keys(MODEL, list(range(47)), 16) == block_keys(MODEL, list(range(32)), 16)
    assert block_keys(MODEL, [], 16) == []


def test_model_id_changes_every_key() -> None:
    a = block_keys(MODEL, list(range(64)), 16)
    b = block_keys(MODEL + "-other", list(range(64)), 16)
    assert len(a) == len(b) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_changed_token_changes_that_key_and_every_later_one() -> None:
    tokens = list(range(64))
    base = block_keys(MODEL, tokens, 16)
    changed = list(tokens)
    changed[20] = 999  # inside block 1
    other = block_keys(MODEL, changed, 16)
    assert other[0] == base[0]
    assert all(x != y for x, y in zip(base[1:], other[1:], strict=True))


def test_digests_chain_from_root() -> None:
    root = root_key(MODEL)
    digests = block_key_digests(root, list(range(32)), 16)
    assert digests[0] == chain_key(root, list(range(16)))
    assert digests[1] == chain_key(digests[0], list(range(16, 32)))


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="token ids"):
        chain_key(root_key(MODEL), [-1])
    with pytest.raises(ValueError, match="token ids"):
        chain_key(root_key(MODEL), [2**32])
    with pytest.raises(ValueError, match="block_size"):
        block_keys(MODEL, [1, 2], 0)
    with pytest.raises(ValueError, match="16 bytes"):
        chain_key(b"short", [1])


def test_a_cache_salt_roots_keys_apart() -> None:
    """vLLM's cache_salt: a request's keys chain from its own root, as the module docstring spells
    it; None is the model's root; two salts (or a salt and none) share no key."""
    root = root_key(MODEL)
    salted = salted_root(root, "tenant-a")
    assert salted == xxhash.xxh3_128(root + b"\0cache_salt\0tenant-a", seed=BLOCK_HASH_SEED).digest()
    assert salted.hex() == "52d209129a5c2507948d5cd69cf478ae"  # pinned: changing it renames salted blocks
    assert salted_root(root, None) == root
    tokens = list(range(48))
    keys = {
        salt: block_key_digests(salted_root(root, salt), tokens, 16)
        for salt in (None, "tenant-a", "tenant-b", "é")
    }
    assert keys["tenant-a"] == block_key_digests(salted, tokens, 16)
    every = [k for ks in keys.values() for k in ks]
    assert len(set(every)) == len(every) == 12
    for bad in ("", 5, b"tenant"):
        with pytest.raises(ValueError, match="cache_salt"):
            salted_root(root, bad)  # type: ignore[arg-type]
