"""The conductor's admin API: read the policy; change it at run time only with the admin token."""

from __future__ import annotations

import argparse

import httpx
from yutu.config import DEFAULT_DISAGG_THRESHOLD
from yutu.service import admin_app

from services.conductor.service import ConductorService
from services.conductor.settings import ConductorSettings, add_arguments


def conductor(*flags: str) -> ConductorService:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return ConductorService(ConductorSettings.from_args(parser.parse_args(list(flags))))


async def test_policy_is_read_freely_and_changed_only_with_the_admin_token() -> None:
    service = conductor("--policy", "cache_aware", "--admin-token", "s3cret", "--slo-ttft-ms", "800")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(admin_app(service)), base_url="http://c"
    ) as http:
        got = (await http.get("/policy")).json()
        assert (
            got["policy"] == "cache_aware"
            and got["slo_ttft_ms"] == 800
            and got["disagg_threshold"] == DEFAULT_DISAGG_THRESHOLD
        )
        change = {"policy": "round_robin", "disagg_threshold": 0}
        assert (await http.put("/policy", json=change)).status_code == 401
        wrong = await http.put("/policy", json=change, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await http.put("/policy", json=change, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["policy"] == "round_robin"
        assert service.policy.name == "round_robin" and service.options.disagg_threshold == 0
        assert service.options.slo_ttft_s == 0.8  # what the change did not name stays
        bad = await http.put(
            "/policy", json={"policy": "fastest"}, headers={"Authorization": "Bearer s3cret"}
        )
        assert bad.status_code == 400 and "fastest" in bad.text
        assert service.policy.name == "round_robin"
        recent = (await http.get("/placements/recent")).json()
        assert recent == {"placements": []}


async def test_without_an_admin_token_the_policy_is_fixed() -> None:
    service = conductor()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(admin_app(service)), base_url="http://c"
    ) as http:
        assert (await http.get("/policy")).json()["policy"] == "kvcentric"
        resp = await http.put(
            "/policy", json={"policy": "round_robin"}, headers={"Authorization": "Bearer x"}
        )
        assert resp.status_code == 403 and "--admin-token" in resp.text
