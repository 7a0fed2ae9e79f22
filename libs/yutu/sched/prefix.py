"""Prefix matching: how many of a request's leading blocks a cache, and then the store, can supply.

A request's blocks, with the ranges a plan names (``bs`` = block size, ``L`` = prompt length)::

    block:  0 .......... local-1 | local ........ reach-1 | reach ......... ceil(L/bs)-1
            [ local prefix cache ] [ fetchable from store ] [ computed (last block always) ]

``local``: leading keys found in the instance's own cache, stopping at the first miss. ``reach``:
``local`` plus the run of keys after it that the store holds (stopping at the store's first miss),
i.e. the longest prefix the instance can have without computing. Both are capped at
:func:`usable_blocks`, so the block holding the last prompt token is always computed (the model must
produce that token's logits).
"""

from __future__ import annotations

from collections.abc import Sequence

from yutu.sched.view import KeySet


def usable_blocks(prompt_len: int, block_size: int, num_keys: int) -> int:
    """Most leading blocks a prefix may cover: never the block of the last prompt token.

    ``(prompt_len - 1) // block_size``, and never more than the request has keys for.
    """
    return min((prompt_len - 1) // block_size, num_keys)


def leading_hits(keys: Sequence[str], held: KeySet, start: int = 0, limit: int | None = None) -> int:
    """Number of consecutive keys ``keys[start], keys[start+1], ...`` in ``held``, at most ``limit``.

    Stops at the first miss; ``limit`` (default: all remaining keys) bounds the count, not the index.
    """
    end = len(keys) if limit is None else min(len(keys), start + limit)
    count = 0
    for i in range(start, end):
        if keys[i] not in held:
            break
        count += 1
    return count


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def match(keys: Sequence[str], cache: KeySet, store: KeySet, usable: int) -> tuple[int, int]:
    """``(local, reach)`` in blocks for one instance (see the module docstring); ``local <= reach``."""
    local = leading_hits(keys, cache, 0, usable)
    return local, local + leading_hits(keys, store, local, usable - local)
