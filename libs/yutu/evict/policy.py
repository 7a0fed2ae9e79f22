"""The eviction-policy interface: what a cache tells a policy, and what the policy answers.

A policy only *orders* resident keys; it never evicts on its own. The caller (the store master,
or a simulator) owns the objects and their sizes:

    policy.insert(key, size)      # a new object became resident (re-insert of a resident key = access)
    policy.access(key)            # a hit on a resident key
    victims = policy.victims(need, protected)   # whom to evict to free ``need`` units
    for key in victims: ...; policy.remove(key) # the caller evicts what it actually can
    policy.remove(key)            # also for a delete: the key is no longer resident

``victims`` does not change the policy's state (apart from remembering, for the adaptive policy,
which keys it proposed, so that their ``remove`` is known to be an eviction). It skips every key
for which ``protected(key)`` is true -- leased (a reader may be copying it), pinned, being written --
and answers fewer keys than asked when not enough is unprotected. Sizes are in the caller's units
(bytes or blocks) and must be positive. Everything here is deterministic: no clock, no randomness;
ties are broken by age (the key that got its place in the order first goes first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable


def never_protected(key: str) -> bool:
    """The default ``protected`` predicate: nothing is protected."""
    return False


@runtime_checkable
class EvictionPolicy(Protocol):
    """What every policy implements (see the module docstring for the calling protocol)."""

    name: str

    def insert(self, key: str, size: int = 1) -> None:
        """A new object of ``size`` units is resident; for a resident key, an access (and the new size)."""

    def access(self, key: str) -> None:
        """A hit on a resident key. Raises :class:`KeyError` for a key that is not resident."""

    def remove(self, key: str) -> None:
        """The caller dropped ``key`` (deleted or evicted it); a key that is not resident is a no-op."""

    def victims(self, need: int, protected: Callable[[str], bool] = never_protected) -> list[str]:
        """Keys to evict, in eviction order, whose sizes sum to at least ``need`` (fewer when not
        enough is unprotected; none when ``need <= 0``). Never a key with ``protected(key)`` true.
        Does not remove them."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    @property
    def used(self) -> int:
        """The sum of the resident keys' sizes."""
        ...


@runtime_checkable
class Resizable(Protocol):
    """A policy whose decisions depend on the cache's capacity (the adaptive one); a cache whose
    capacity changes calls ``resize`` (not part of :class:`EvictionPolicy`: the others ignore it)."""

    def resize(self, capacity: int) -> None: ...


def check_size(size: int) -> int:
    """``size`` if it is a positive int, else a :class:`ValueError` saying so."""
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"an object's size must be a positive int (in the cache's units), got {size!r}")
    return size
