"""Admin REST routes of the store master (mounted next to /health, /ready, /metrics, /info)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, HTTPException

from services.store_master.replies import describe

if TYPE_CHECKING:
    from services.store_master.service import StoreMasterService


def build_router(service: StoreMasterService) -> APIRouter:
    router = APIRouter()
    state = service.state

    @router.get("/stats")
    async def stats() -> dict[str, Any]:
        return service.stats()

    @router.post("/debug/check_integrity")
    async def check_integrity() -> dict[str, Any]:
        """Assert that allocations, replicas and the LRU agree (a read-only check; tests call it)."""
        try:
            state.check()
        except AssertionError as exc:
            raise HTTPException(500, f"store metadata integrity: {exc}") from None
        return {"ok": True, "objects": sum(1 for e in state.objects.values() if e.readable)}

    @router.get("/segments")
    async def segments() -> list[dict[str, Any]]:
        return [state.segments.describe(n) for n in sorted(state.segments.segments)]

    @router.get("/objects/{key:path}")
    async def get_object(key: str) -> dict[str, Any]:
        entry = state.objects.get(key)
        if entry is None:
            raise HTTPException(404, f"object {key!r} not found in the store")
        now = state.clock()
        return {
            "key": entry.key,
            "size": entry.size,
            "readable": entry.readable,
            "replicas": [describe(state.segments, r) for r in entry.replicas],
            "pending": None
            if entry.pending is None
            else {
                "put_id": entry.pending.put_id,
                "size": entry.pending.size,
                "writer": entry.pending.writer,
                "started_at": entry.pending.started_at,
                "replicas": [describe(state.segments, r) for r in entry.pending.replicas],
            },
            "created_at": entry.created_at,
            "leased_for_s": max(0.0, entry.lease_until - now),
            "soft_pin": entry.soft_pin,
            "pinned_for_s": max(0.0, entry.pin_until - now) if entry.soft_pin else 0.0,
            "protection": entry.protection(now),
            "access_count": entry.access_count,
        }

    return router
