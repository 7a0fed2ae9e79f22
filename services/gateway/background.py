"""Background responses: ``"background": true`` on ``POST /v1/responses``.

The request is answered at once with the response ``queued`` (with ``stream``: its events, as they
are made), and the response is made detached from it: ``GET /v1/responses/{id}`` follows it through
``in_progress`` to how it ended (``completed``, ``incomplete``, ``failed``, ``cancelled``), ``GET
/v1/responses/{id}?stream=true&starting_after=N`` streams its events from after sequence number N
(a client whose stream dropped picks it up there; without N, from the start), and ``POST
/v1/responses/{id}/cancel`` stops it. Background responses are stored responses (services/gateway/response_store.py): they
need ``store`` and a gateway that keeps responses.

The route starts the chat completion as a stream, so checking, admission and placement happen in
the request (a bad or refused request is still an HTTP error, not a failed response), then hands
the stream to a task of this gateway's :class:`BackgroundResponses`, which makes the response from
it as the streaming route does (``ResponseEvents``) and writes it to the record, which names this
gateway (its instance id) while it runs. Every event it makes is kept in Redis as it comes, and a
stream of the response reads them there (waiting in ``XREAD`` for the next), so any gateway serves
it, during the response or after, and every client reads the same events. Any gateway of the deployment answers for it:

- **cancel** marks the record ``cancelled`` at once (a response that ended meanwhile stays as it
  ended) and raises its cancel flag; the gateway running it stops the generation (the workers
  drop it) when it sees the flag -- it looks every ``CANCEL_POLL_S`` -- or at once when it is the
  gateway asked. Deleting a running response cancels it the same way.
- the runner's last write lands only while the record still says ``queued`` or ``in_progress``,
  so a cancel or a delete is never undone by it.
- a gateway that stops (Ctrl-C, SIGTERM) fails what it still runs (``failed``, ``server_error``);
  a gateway that died is found out when its registry record has expired: the gateway asked next
  about a response it ran reports it ``failed`` (and writes so; a stream of it ends with that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from redis.exceptions import RedisError
from yutu.registry import Registry

from services.gateway.errors import ApiError, invalid
from services.gateway.response_store import ResponseStore, StoredResponse
from services.gateway.responses_api import ResponseEvents, Shell, response_event
from services.gateway.streaming import EventStream

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.2  # how often a running background response looks for its cancel flag
READ_BLOCK_MS = 500  # how long a stream waits in Redis for the next event before looking at the record
# the events a kept stream ends with (an error event comes before a response.failed)
LAST_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
)
GATEWAY_KIND = "gateway"


class BackgroundResponses:
    """The background responses this gateway runs (module docstring)."""

    def __init__(self, store: ResponseStore, instance_id: str, registry: Registry) -> None:
        self.store = store
        self.instance_id = instance_id
        self.registry = registry
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()  # stopped by a cancel (not by this gateway stopping)

    async def start(
        self, shell: Shell, items: list[dict[str, Any]], owner: str, answer: EventStream,
        count_tokens: Callable[[str], int],
    ) -> StoredResponse:  # fmt: skip
        """Keep the response ``queued`` and make it from ``answer`` (the chat completion's stream,
        its generation started) in a task; the response as it is kept now."""
        queued = StoredResponse(shell.response("queued", [], None), items, owner, self.instance_id)
        try:
            await self.store.save(queued)
        except ApiError:
            answer.close_generation()
            raise
        task = asyncio.create_task(
            self._run(queued, shell, answer, count_tokens), name=f"background {shell.id}"
        )
        self.tasks[shell.id] = task
        task.add_done_callback(lambda _: self.tasks.pop(shell.id, None))
        task.add_done_callback(lambda _: answer.close_generation())  # also if cancelled before it ran
        return queued

    async def _run(
        self, queued: StoredResponse, shell: Shell, answer: EventStream, count_tokens: Callable[[str], int]
    ) -> None:
        """Make the response: its record written as it starts and as it ends, its events kept as
        they come (for :meth:`stream`), the last one once the record says how it ended."""
        rid, owner = shell.id, queued.owner
        made: list[tuple[int, str]] = []
        events = ResponseEvents(shell, count_tokens, made)
        chat_events = answer.body_iterator
        watch = asyncio.create_task(self._watch(rid, asyncio.current_task()))
        ended: dict[str, Any] | None = None
        try:
            events.start("queued")
            await self._write(rid, owner, shell.response("in_progress", [], None))
            await self._keep(rid, made)
            async for data in chat_events:
                events.feed(data if isinstance(data, str) else bytes(data).decode())
                if events.ended:
                    break
                await self._keep(rid, made)
            ended = events.final or shell.response(
                "failed", events.output, None,
                events.error or {"code": "server_error", "message": "the generation ended without an answer"},
            )  # fmt: skip
        except asyncio.CancelledError:
            if rid in self._cancelled:  # the record says cancelled already (as the canceller wrote it)
                self._cancelled.discard(rid)
                ended = shell.response("cancelled", [], None)
                return
            ended = shell.response("failed", events.output, None, _stopped(self.instance_id))
            raise
        finally:
            watch.cancel()
            close = getattr(chat_events, "aclose", None)
            if close is not None:
                await close()
            answer.close_generation()
            if ended is not None:
                after = await self._write(rid, owner, ended, last=True)
                if after is not None:  # not deleted: its last event says what the record says
                    events.ended_with(after.response)
                    await self._keep(rid, made)

    async def _write(
        self, rid: str, owner: str, response: dict[str, Any], last: bool = False
    ) -> StoredResponse | None:
        """The record says ``response`` now, unless it has ended (cancelled) or is gone (deleted):
        the record as it is after. A Redis that cannot be reached is logged (None)."""

        def update(stored: StoredResponse) -> StoredResponse | None:
            if not stored.running:
                return None
            return replace(stored, response=response, runner=None if last else stored.runner)

        try:
            return await self.store.change(rid, owner, update)
        except ApiError as exc:
            log.warning(
                "background response %s: could not write that it is %s: %s", rid, response["status"], exc
            )
            return None

    async def _keep(self, rid: str, made: list[tuple[int, str]]) -> None:
        """The events made since the last call, kept for the clients that stream the response."""
        if not made:
            return
        try:
            await self.store.append_events(rid, made)
        except ApiError as exc:
            log.warning("background response %s: could not keep %d events: %s", rid, len(made), exc)
        made.clear()

    async def stream(self, stored: StoredResponse, after: int) -> AsyncIterator[str]:
        """The events of a background response after sequence number ``after`` (-1: all of them),
        as they are made, until its last one. One whose gateway died before it sent a last event
        ends with one saying how it ended (as its record does)."""
        rid = stored.response["id"]
        try:
            while True:
                got = await self.store.read_events(rid, after, READ_BLOCK_MS)
                if not got:
                    now = await self.store.load(rid, stored.owner)
                    if now is None:
                        return  # deleted
                    now = await self.settled(now)
                    if now.running:
                        continue
                    got = await self.store.read_events(rid, after, None)  # its last events, if they came
                    if not any(_is_last(text) for _, text in got):
                        last = after + len(got) + 1
                        got.append((last, response_event(f"response.{now.response['status']}", last,
                                                         response=now.response)))  # fmt: skip
                for sequence, text in got:
                    yield text
                    after = sequence
                    if _is_last(text):
                        return
        except ApiError as err:  # Redis away mid-stream: said as the stream's error event
            yield response_event("error", after + 1, code="server_error", message=err.message, param=None)

    async def _watch(self, rid: str, task: asyncio.Task[Any] | None) -> None:
        """Stop ``task`` once a cancel is asked for, on any gateway."""
        assert task is not None
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            try:
                asked = await self.store.cancel_requested(rid)
            except ApiError:
                continue  # Redis away: the response goes on; it ends or is looked at again
            if asked:
                self._cancelled.add(rid)
                task.cancel()
                return

    async def settled(self, stored: StoredResponse) -> StoredResponse:
        """``stored``, or -- when it says it runs on a gateway that is gone -- failed (and written so)."""
        if not stored.running or stored.runner is None or await self._alive(stored):
            return stored
        failed = {**stored.response, "status": "failed", "error": _stopped(stored.runner)}

        def update(current: StoredResponse) -> StoredResponse | None:
            return replace(current, response=failed, runner=None) if current.running else None

        return await self.store.change(stored.response["id"], stored.owner, update) or stored

    async def _alive(self, stored: StoredResponse) -> bool:
        if stored.runner == self.instance_id:
            return stored.response["id"] in self.tasks
        try:
            return await self.registry.get(GATEWAY_KIND, stored.runner or "") is not None
        except (RedisError, OSError, ValueError) as exc:  # not known: not taken for dead
            log.warning("cannot tell whether gateway %s is alive: %s", stored.runner, exc)
            return True

    async def cancel(self, stored: StoredResponse) -> StoredResponse:
        """Cancel a background response (``POST /v1/responses/{id}/cancel``): the record as it is after."""
        if not stored.response.get("background"):
            raise invalid("Only responses made with background true can be cancelled", None)
        if not stored.running:
            return _cancellable(stored)
        rid = stored.response["id"]

        def update(current: StoredResponse) -> StoredResponse | None:
            if not current.running:
                return None
            return replace(current, response={**current.response, "status": "cancelled"}, runner=None)

        after = await self.store.change(rid, stored.owner, update)
        await self.stop(rid)
        return _cancellable(after or stored)

    async def stop(self, rid: str) -> None:
        """Stop the generation of ``rid``, wherever it runs (a cancel, a delete)."""
        await self.store.request_cancel(rid)
        task = self.tasks.get(rid)
        if task is not None:
            self._cancelled.add(rid)
            task.cancel()

    async def close(self) -> None:
        """This gateway stops: what it still runs fails (module docstring)."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def info(self) -> dict[str, Any]:
        return {"running": sorted(self.tasks)}


def _is_last(text: str) -> bool:
    """Whether a kept event ends its response's stream (the one of the status it ended with)."""
    kind = text.partition("\n")[0].removeprefix("event: ")
    return kind in LAST_EVENTS


def _cancellable(stored: StoredResponse) -> StoredResponse:
    """``stored`` if it is cancelled (cancelling again is answered the same); a 400 if it ended otherwise."""
    status = stored.response["status"]
    if status not in ("cancelled", "queued", "in_progress"):
        raise invalid(f"Cannot cancel a response that is {status}", None)
    return stored


def _stopped(runner: str) -> dict[str, str]:
    return {
        "code": "server_error",
        "message": f"the gateway running this response ({runner}) stopped before it finished; create it again",
    }
