"""Refuses request bodies over a size limit with a 413 in the OpenAI envelope, before parsing them.

Pure ASGI so nothing is buffered: a declared ``Content-Length`` over the limit is answered at once;
a chunked body is counted as it arrives and cut off when it passes the limit (the app may wrap the
cut-off in an error of its own; that answer is replaced by the 413).
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from yutu.errors import ErrorKind

from services.gateway.errors import error_body


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        received = 0
        too_large = False  # set while the app reads the body; whatever it answers then is replaced

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _TooLarge
            return message

        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if not too_large:
                started = started or message["type"] == "http.response.start"
                await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _TooLarge:
            pass
        if too_large and not started:  # (a route that answers before reading its body keeps its answer)
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            error_body(
                f"request body is larger than {self.max_bytes} bytes; send a smaller request"
                " (the gateway's --max-request-bytes sets the limit)",
                ErrorKind.TOO_LARGE.value,
            )
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
