"""Batch requests: one outcome per item, in order, with a fast path for batches that need no
awaiting."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from yutu.errors import ErrorKind, YutuError
from yutu.protocol import store as p

from services.store_master.settings import MasterSettings

_PLAIN = (list, int, str, bytes, type(None))  # batch item values that are surely not awaitable


class Batching:
    """Mixin of :class:`~services.store_master.service.StoreMasterService`: runs a batch request
    item by item, failing items one by one (a bad item does not fail the batch)."""

    settings: MasterSettings

    def _batch(self, items: list[Any], one: Callable[[Any], Any]) -> Any:
        """One outcome per item, in order; ``one`` returns a value, or an awaitable of it for the slow
        path. Returns the ``BatchReply``, or an awaitable of it once an item needed awaiting."""
        if not isinstance(items, list):
            raise YutuError("a batch request needs a list", ErrorKind.INVALID_REQUEST)
        results: list[p.Outcome] = []
        for index, item in enumerate(items):
            try:
                value = one(item)
            except YutuError as exc:
                results.append(p.failed(exc.kind, str(exc)))
                continue
            if not isinstance(value, _PLAIN) and inspect.isawaitable(value):
                return self._batch_rest(items, one, results, index, value)
            results.append([None, value])
        return p.BatchReply(results, self.settings.policy.lease_ttl_s)

    async def _batch_rest(
        self, items: list[Any], one: Callable[[Any], Any], results: list[p.Outcome], index: int, first: Any
    ) -> p.BatchReply:
        """``_batch`` from ``items[index]`` on, for which ``one`` returned the awaitable ``first``."""
        for item in items[index:]:
            try:
                value = first if first is not None else one(item)
                first = None
                if inspect.isawaitable(value):
                    value = await value
                results.append([None, value])
            except YutuError as exc:
                results.append(p.failed(exc.kind, str(exc)))
        return p.BatchReply(results, self.settings.policy.lease_ttl_s)
