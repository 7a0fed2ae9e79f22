"""The conductor's admin API (read the policy; change it at run time only with the admin token) and its channel."""

from __future__ import annotations

import argparse

import httpx
import pytest
from yutu.config import DEFAULT_DISAGG_THRESHOLD
from yutu.errors import ErrorKind, YutuError
from yutu.protocol import conductor as c
from yutu.registry import Registry
from yutu.rpc import RpcClient
from yutu.rpc.stream import StreamRpcClient
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
            and got["prefill_stealing"] is False
        )
        change = {"policy": "round_robin", "disagg_threshold": 0, "prefill_stealing": True}
        assert (await http.put("/policy", json=change)).status_code == 401
        wrong = await http.put("/policy", json=change, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await http.put("/policy", json=change, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["policy"] == "round_robin"
        assert service.policy.name == "round_robin" and service.options.disagg_threshold == 0
        assert service.policy.options.prefill_stealing is True and ok.json()["prefill_stealing"] is True
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


async def test_the_channel_answers_alike_over_zeromq_and_the_plain_stream(
    redis_url: str, registry_prefix: str
) -> None:
    service = conductor("--redis-url", redis_url, "--registry-prefix", registry_prefix, "--host", "127.0.0.1")
    await service.startup()
    try:
        registry = Registry.from_url(redis_url, registry_prefix)
        try:
            (record,) = await registry.list("conductor")
        finally:
            await registry.close()
        assert set(record.endpoints) >= {"rpc", "rpc_stream"}
        zmq_client = RpcClient(c.CHANNEL, record.endpoints["rpc"], 5.0)
        stream_client = StreamRpcClient(c.CHANNEL, record.endpoints["rpc_stream"], 5.0)
        try:
            place = c.Place("r1", ["00" * 16], 20, 4, [])
            replies = [await client.call(place) for client in (zmq_client, stream_client)]
            assert replies[0] == replies[1]
            assert isinstance(replies[0], c.Rejected)  # no instance registered: nowhere to place it
            for client in (zmq_client, stream_client):
                assert await client.call(c.Finished("r1")) == c.Ack("r1")
                with pytest.raises(YutuError) as err:
                    await client.call(c.Ack("r1"))  # not a request of this channel
                assert err.value.kind is ErrorKind.INVALID_REQUEST
        finally:
            await zmq_client.close()
            await stream_client.close()
    finally:
        await service.shutdown()
