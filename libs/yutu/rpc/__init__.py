"""Async ZeroMQ plumbing: one socket wrapper for every channel, and request/reply RPC on it.

Every channel rides an :class:`Endpoint`: a plain (non-blocking) ROUTER or DEALER socket driven
from the event loop by :class:`~yutu.pump.Pump`, a reader callback on the socket's notification descriptor
that drains every waiting message, so a message costs no future and no task. Sends never block:
they return a :class:`Sent` outcome, and a ROUTER reports a peer it cannot route to
(``ROUTER_MANDATORY``) to the caller instead of dropping the message silently. Nothing here blocks
the event loop; bulk bytes never ride here (they go through :mod:`yutu.transfer`).

Two framings sit on an Endpoint:

- :class:`Peer`, a streaming channel: typed messages of one
  :class:`~yutu.protocol.codec.Channel`, one handler per message type. A channel is added by
  declaring its messages and handlers::

      peer = Peer.router(CHANNEL, {GenerateRequest: admit, Ping: answer}, host, port)
      peer.send(TokenDelta(...), to=identity)       # -> Sent.SENT | Sent.UNROUTABLE | ...

  Frames: ``[identity, payload]`` on a ROUTER, ``[payload]`` on a DEALER. Its twin over plain TCP,
  :class:`StreamPeer` (same methods, same contract, no ZeroMQ I/O thread), carries the generate
  channel, where a message goes out per engine step.

- :class:`RpcServer` / :class:`RpcClient`, request/reply over DEALER (client) -> ROUTER (server)::

      client -> server:  [call_id (8 bytes), payload]
      server -> client:  [call_id, b"K", payload]                 a reply message
                         [call_id, b"E", msgpack([kind, message])] a typed error

A frame that does not decode is logged and dropped (or, to an RPC server, answered as an invalid
request); it never raises into the loop.
"""

from yutu.rpc.kv_events import KVEventPublisher, KVEventSubscriber
from yutu.rpc.peer import MessageHandler, OnConnection, Peer
from yutu.rpc.pubsub import Publisher, Subscriber
from yutu.rpc.reqrep import Handler, RpcClient, RpcServer
from yutu.rpc.sockets import Endpoint, Sent, bind, context
from yutu.rpc.stream_peer import StreamPeer

__all__ = [
    "Endpoint",
    "Handler",
    "KVEventPublisher",
    "KVEventSubscriber",
    "MessageHandler",
    "OnConnection",
    "Peer",
    "Publisher",
    "RpcClient",
    "RpcServer",
    "Sent",
    "StreamPeer",
    "Subscriber",
    "bind",
    "context",
]
