"""The gateway service: the OpenAI-compatible front end of one served model.

It loads the model's tokenizer (the same directory the workers load: ``resolve_model(--model)``),
watches the registry for workers serving that model, and registers itself as kind "gateway".
The API, /health, /ready, /metrics and /info share one HTTP port (see app.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from yutu.engine.model_source import model_to_serve, served_model_name
from yutu.engine.tokenizer import Tokenizer
from yutu.errors import ErrorKind, YutuError
from yutu.redis_conn import connect
from yutu.registry import Registration, Registry, ServiceRecord
from yutu.service import Service

from services.gateway.background import BackgroundResponses
from services.gateway.conductor_client import ConductorClient
from services.gateway.memory import MemoryReleaser, rss_bytes
from services.gateway.metrics import GatewayMetrics
from services.gateway.prefill_pool import PrefillPool
from services.gateway.response_store import ResponseStore
from services.gateway.routing import DisaggRouter, MixedRouter, Router
from services.gateway.settings import GatewaySettings
from services.gateway.tokenization import PromptTokenizer, default_threads
from services.gateway.tokens import TokenText
from services.gateway.workers import WorkerPool

log = logging.getLogger(__name__)

DEMO_NOTE = "random weights: text is meaningless; serve a real checkpoint with make run MODEL=/path/to/hf-dir"


def served_name(settings: GatewaySettings, model_dir: Path) -> str:
    """The model name clients use: --served-model-name, else the rule the worker applies too."""
    return settings.served_model_name or served_model_name(settings.model, model_dir)


class GatewayService(Service):
    kind = "gateway"

    def __init__(self, settings: GatewaySettings) -> None:
        super().__init__()
        self.settings = settings
        self.model_dir: Path | None = None
        self.model_name = settings.served_model_name or ""
        self.created = int(time.time())
        self._tokenizer: Tokenizer | None = None
        self._token_text: TokenText | None = None
        self._prompts: PromptTokenizer | None = None
        self.memory = MemoryReleaser()
        self._pool: WorkerPool | None = None  # mixed workers
        self._decodes: WorkerPool | None = None  # decode instances (disaggregated deployment)
        self._prefills: PrefillPool | None = None
        self._conductor: ConductorClient | None = None
        self._mixed: MixedRouter | None = None
        self._disagg: DisaggRouter | None = None
        self._metrics: GatewayMetrics | None = None
        self._registry: Registry | None = None
        self._registration: Registration | None = None
        self.responses: ResponseStore | None = None  # stored responses (None: --responses-ttl 0)
        self.background: BackgroundResponses | None = None  # with stored responses

    # -- lifecycle -------------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        model_dir = await asyncio.to_thread(model_to_serve, s.model)
        self.model_dir = model_dir
        self._tokenizer = await asyncio.to_thread(Tokenizer.from_dir, model_dir)
        self._token_text = TokenText(self._tokenizer)
        threads = s.tokenizer_threads or default_threads()
        self._prompts = PromptTokenizer(self._tokenizer, threads, self.memory)
        if self._prompts.span is None:
            log.warning(
                "this tokenizer can map unbounded text to one token (or its bound is unprovable):"
                " over-long prompts are refused only after tokenizing"
            )
        self.loops.spawn("memory-release", self.memory.run())
        self.model_name = served_name(s, model_dir)
        self._metrics = GatewayMetrics(self.metrics, self.model_name)
        self._registry = Registry.from_url(s.redis_url, s.registry_prefix)
        if s.responses_ttl_s > 0:
            self.responses = ResponseStore(connect(s.redis_url), s.registry_prefix, s.responses_ttl_s)
            self.background = BackgroundResponses(self.responses, s.instance_id, self._registry)
        self._pool = WorkerPool(
            self._registry,
            self.model_name,
            self.loops,
            poll_s=s.registry_poll_s,
            grace_s=s.registry_ttl_s,
            liveness_timeout_s=s.worker_liveness_timeout_s,
        )
        await self._pool.start()
        self._decodes = WorkerPool(
            self._registry,
            self.model_name,
            self.loops,
            poll_s=s.registry_poll_s,
            grace_s=s.registry_ttl_s,
            liveness_timeout_s=s.worker_liveness_timeout_s,
            kind="decode",
        )
        await self._decodes.start()
        self._prefills = PrefillPool(
            self._registry, self.model_name, self.loops, s.registry_poll_s, s.worker_liveness_timeout_s
        )
        await self._prefills.start()
        self._conductor = ConductorClient(self._registry, self.loops, s.registry_poll_s)
        await self._conductor.start()
        self._mixed = MixedRouter(self._pool, self._metrics, s.failover_wait_s)
        # Block keys as the workers compute them: salted as they advertise (by default with the
        # model directory's name, the engine's salt in float32).
        self._disagg = DisaggRouter(
            self._decodes, self._prefills, self._conductor, model_dir.name, self._metrics, s.failover_wait_s
        )
        record = ServiceRecord(
            kind=self.kind,
            instance_id=s.instance_id,
            endpoints={"http": self.http_url},
            meta={"model": self.model_name, "auth": bool(s.api_keys)},
        )
        self._registration = Registration(self._registry, record, s.registry_ttl_s, supervisor=self.loops)
        await self._registration.start()
        log.info(
            "gateway %s serving %r (tokenizer from %s) on %s; so far %d worker(s), %d prefill and %d decode instance(s)",
            s.instance_id,
            self.model_name,
            self.model_dir,
            self.http_url,
            len(self._pool.workers),
            len(self._prefills.instances),
            len(self._decodes.workers),
        )

    async def drain(self) -> None:
        if self._registration is not None:
            await self._registration.close()
            self._registration = None

    async def shutdown(self) -> None:
        if self._registration is not None:
            await self._registration.close()
            self._registration = None
        if self.background is not None:  # what still runs fails, written while Redis is there
            await self.background.close()
        for pool in (self._pool, self._decodes, self._prefills, self._conductor):
            if pool is not None:
                await pool.close()
        if self._registry is not None:
            await self._registry.close()
        if self.responses is not None:
            await self.responses.close()
        if self._prompts is not None:
            self._prompts.close()

    def is_ready(self) -> bool:
        return self._pool is not None

    def problems(self) -> list[str]:
        """The supervisor's, plus "no live worker" (none registered, or none answering heartbeats)."""
        problems = super().problems()
        if self._pool is not None and not self.pool.live():
            problems.append(
                f"no live worker serving model {self.model_name!r}: no mixed worker or decode instance"
                " is registered, connected and answering heartbeats"
            )
        return problems

    def info(self) -> dict[str, Any]:
        workers = [] if self._pool is None else list(self._pool.workers.values())
        decodes = [] if self._decodes is None else list(self._decodes.workers.values())
        prefills = [] if self._prefills is None else list(self._prefills.instances.values())
        return {
            "kind": self.kind,
            "instance_id": self.settings.instance_id,
            "model": self.model_name,
            "model_dir": str(self.model_dir),
            "auth": bool(self.settings.api_keys),
            "workers": [w.info_dict() for w in workers],
            "decode": [w.info_dict() for w in decodes],
            "prefill": [
                {"instance_id": c.instance_id, "usable": c.usable, "in_flight": c.in_flight} for c in prefills
            ],
            "conductor": None
            if self._conductor is None
            else {"instance_id": self._conductor.instance_id, "endpoint": self._conductor.endpoint},
            "disaggregated": self.disaggregated,
            "limits": asdict(self.settings.limits),
            "tokenizer": None if self._prompts is None else self._prompts.info(),
            "memory": {"rss_bytes": rss_bytes(), "trims": self.memory.trims},
            "background_responses": None if self.background is None else self.background.info(),
        }

    # -- what the routes use -----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._tokenizer is not None, "used before startup"
        return self._tokenizer

    @property
    def prompts(self) -> PromptTokenizer:
        assert self._prompts is not None, "used before startup"
        return self._prompts

    @property
    def token_text(self) -> TokenText:
        assert self._token_text is not None, "used before startup"
        return self._token_text

    @property
    def disaggregated(self) -> bool:
        """Whether requests take the disaggregated path: decode instances are registered for the
        model (a deployment runs mixed workers, or prefill and decode instances)."""
        return self._decodes is not None and bool(self._decodes.usable())

    @property
    def pool(self) -> WorkerPool:
        """The pool that streams tokens: decode instances when there are any, else mixed workers."""
        assert self._pool is not None and self._decodes is not None, "used before startup"
        return self._decodes if self.disaggregated else self._pool

    @property
    def router(self) -> Router:
        """Where requests go: the disaggregated path when decode instances serve the model, else
        straight to mixed workers."""
        assert self._mixed is not None and self._disagg is not None, "used before startup"
        return self._disagg if self.disaggregated else self._mixed

    @property
    def gateway_metrics(self) -> GatewayMetrics:
        assert self._metrics is not None, "used before startup"
        return self._metrics

    def require_max_model_len(self) -> int:
        """The context length of the available workers; 503 when there is none."""
        max_len = self.pool.max_model_len
        if max_len is None:
            self.pool.pick()  # raises the UNAVAILABLE error with its how-to message
            raise YutuError("no worker available", ErrorKind.UNAVAILABLE)  # unreachable
        return max_len

    def metrics_counter_requests(self, route: str, status: str) -> None:
        if self._metrics is not None:
            self._metrics.requests.labels(route, status).inc()
