"""Chained block keys: the name of a KV block, shared by every process.

A sequence's tokens are cut into blocks of ``block_size``; only *full* blocks get a key. The key of
block ``i`` names the whole prefix up to and including that block::

    key_root = XXH3-128(model_id.encode("utf-8"),              seed=BLOCK_HASH_SEED)
    key_0    = XXH3-128(key_root ‖ le_u32(tokens[0:bs]),        seed=BLOCK_HASH_SEED)
    key_i    = XXH3-128(key_{i-1} ‖ le_u32(tokens[i*bs:(i+1)*bs]), seed=BLOCK_HASH_SEED)

A request with a cache salt (vLLM's ``cache_salt``: one per tenant, say) chains from its own root,
so requests of different salts never share a block, in a prefix cache or the store::

    key_root' = XXH3-128(key_root ‖ b"\0cache_salt\0" ‖ utf8(salt),   seed=BLOCK_HASH_SEED)

Digests are the 16-byte canonical (big-endian) XXH3-128 digest; ``‖`` is byte concatenation and
``le_u32`` packs each token id as a little-endian unsigned 32-bit integer. The hex rendering of a key is
both the prefix-cache key and the store object key. Never use Python's ``hash()``: it is salted per
process.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

# Fixed seed for every block key ("Yutu" in ASCII); changing it renames every stored block.
BLOCK_HASH_SEED: int = 0x59757475

KEY_BYTES = 16
_MAX_TOKEN_ID = 0xFFFFFFFF


def root_key(model_id: str) -> bytes:
    """The parent of block 0: the model id hashed alone, so two models never share a key."""
    return xxhash.xxh3_128(model_id.encode("utf-8"), seed=BLOCK_HASH_SEED).digest()


def salted_root(root: bytes, cache_salt: str | None) -> bytes:
    """The root of the keys of a request with ``cache_salt`` (None: ``root`` itself): no block of it
    is ever found by a request of another salt, or of none. ValueError for a salt that is not a
    non-empty string."""
    if cache_salt is None:
        return root
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
    data = root + b"\0cache_salt\0" + cache_salt.encode("utf-8")
    return xxhash.xxh3_128(data, seed=BLOCK_HASH_SEED).digest()


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a block: XXH3-128 of the parent key followed by the block's tokens as little-endian u32.

    Raises ValueError when a token id does not fit in an unsigned 32-bit integer.
    """
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    try:
        packed = struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]: {exc}") from exc
    return xxhash.xxh3_128(parent + packed, seed=BLOCK_HASH_SEED).digest()


def block_key_digests(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Digests of every full block of ``token_ids`` chained from ``root``; a partial tail gets none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size}")
    keys: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


def block_keys(model_id: str, token_ids: Sequence[int], block_size: int) -> list[str]:
    """Hex keys (32 lowercase hex digits) of every full block of ``token_ids`` for ``model_id``."""
    return [k.hex() for k in block_key_digests(root_key(model_id), token_ids, block_size)]
