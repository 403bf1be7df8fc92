"""A session's websocket: admission, the loop that feeds it client events, its time limits (its whole life, and
how long it may stay idle), and its outbox.

Events are handled one at a time in arrival order. What the session sends goes through its
:class:`Outbox`: one writer task takes the events to the socket in order, so no producer (the event
loop, the active response, a transcription) ever waits on the client, and the bytes the client has
not taken are bounded: past ``realtime.max_unsent_bytes`` the client is not reading, and the session
ends (its response cancelled, an ``error`` event, close 1008). The writer sees that only where the
websocket's sends wait on the client; deployed on Serve 2.60 they were not seen to, behind its Python
proxy (a Ray streaming generator without backpressure relays them) nor behind its HAProxy ingress
(docs/realtime.md, "A client that never reads").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omni_serve.api.auth import KeyRing
from omni_serve.api.openai.errors import APIError
from omni_serve.api.realtime import events as ev
from omni_serve.api.realtime.admission import POLICY_VIOLATION, TRY_AGAIN_LATER, client_of, refusal
from omni_serve.api.realtime.session import Session
from omni_serve.api.realtime.session_graph import SessionGraph

FIRST = asyncio.FIRST_COMPLETED
CLOSE_WAIT_S = 2.0  # how long the last events and the close frame may take to go out before the session is dropped


class Outbox:
    """Server events on their way to the socket, in order, and the bytes of them not sent yet."""

    def __init__(self, send_text: Callable[[str], Awaitable[None]], limit: int):
        self._send_text = send_text
        self.limit = limit
        self.unsent = 0  # bytes queued or being written
        self._queue: deque[str] = deque()
        self._ready = asyncio.Event()
        self._drained = asyncio.Event()
        self.overflowed = asyncio.Event()  # the client stopped taking its events: the session must end
        self._writer = asyncio.create_task(self._write())

    def put(self, event: dict[str, Any] | str) -> None:
        """Queue one event: a dict, or its JSON text (serialized already)."""
        if self.overflowed.is_set():
            return  # the session is ending: nothing more goes out but its last error
        self._append(event if isinstance(event, str) else json.dumps(event, separators=(",", ":")))
        if self.unsent > self.limit:
            self.overflowed.set()

    def put_last(self, event: dict[str, Any]) -> None:
        """The session's last event (its error), past the bound: it is one small event."""
        self._append(json.dumps(event, separators=(",", ":")))

    def _append(self, text: str) -> None:
        self.unsent += len(text)  # JSON is ASCII here (json.dumps escapes the rest): characters are bytes
        self._queue.append(text)
        self._drained.clear()
        self._ready.set()

    async def _write(self) -> None:
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while self._queue:
                    text = self._queue[0]
                    await self._send_text(text)
                    self._queue.popleft()
                    self.unsent -= len(text)
                self._drained.set()
        except Exception:  # WebSocketDisconnect, or a send after the close: the client is gone
            return  # what is left is dropped with the session

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for what is queued to go out."""
        if self._queue and not self._writer.done():
            with contextlib.suppress(asyncio.TimeoutError):  # not the builtin before Python 3.11
                await asyncio.wait_for(self._drained.wait(), timeout_s)

    async def close(self) -> None:
        self._writer.cancel()
        await asyncio.gather(self._writer, return_exceptions=True)


async def serve_session(
    websocket: WebSocket, graph: SessionGraph, api_key: KeyRing | None, serve_limit_s: float | None
) -> None:
    """Run one session on ``websocket`` until the client leaves or a limit ends it.

    ``serve_limit_s``: Serve's proxy applies ``http_options.request_timeout_s`` to a websocket's whole
    life (Ray 2.60, ``ProxyResponseGenerator``'s ``timeout_s``) and then drops it without a close frame;
    the session ends itself before that, with its error event and close code.
    """
    protocols = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",")]
    await websocket.accept(subprotocol="realtime" if "realtime" in protocols else None)

    async def send_text(text: str) -> None:
        if websocket.application_state == WebSocketState.CONNECTED:
            await websocket.send_text(text)

    outbox = Outbox(send_text, graph.limits.max_unsent_bytes)
    refused = refusal(websocket, graph.model, graph.limits, api_key, graph.unavailable)
    code = POLICY_VIOLATION
    client = client_of(websocket, api_key)
    if refused is None:  # a client over its own quota (1008): waiting for room on the replica would not help it
        refused = graph.sessions.over_quota(client, graph.limits.max_sessions_per_client)
    if refused is None and (refused := graph.sessions.full()) is not None:
        code = TRY_AGAIN_LATER
    if refused is not None:  # accepted first, so the client reads why in an error event, then the close
        outbox.put_last(ev.error_event(refused, None))
        await _close(websocket, outbox, code, refused.message)
        return
    session = Session(graph, outbox.put)
    graph.sessions.add(session, client, lambda: outbox.unsent)
    ending: APIError | None = None
    try:
        session.send_session("session.created")
        ending = await _events(websocket, session, outbox, serve_limit_s)
    finally:
        graph.sessions.remove(session, client)
        await session.close()
        if ending is not None:
            outbox.put_last(ev.error_event(ending, None))
            await _close(websocket, outbox, POLICY_VIOLATION, ending.code or "error")
        else:
            await outbox.close()


async def _events(
    websocket: WebSocket, session: Session, outbox: Outbox, serve_limit_s: float | None
) -> APIError | None:
    """Feed the client's events to the session until the client leaves (None) or a limit ends the session."""
    limit_s = session.limits.max_session_minutes * 60
    if serve_limit_s is not None and serve_limit_s < limit_s:
        limit_s, limit_name = serve_limit_s, "Serve's http_options.request_timeout_s, less a margin"
    else:
        limit_name = "realtime.max_session_minutes"
    ends = time.monotonic() + limit_s
    expired = APIError(
        400,
        f"the session reached its maximum duration of {limit_s:.0f} s ({limit_name})",
        type="invalid_request_error",
        code="session_expired",
    )
    overflow = asyncio.ensure_future(outbox.overflowed.wait())
    try:
        while True:
            receive = asyncio.ensure_future(websocket.receive())
            while True:
                wait_s, ending = _time_left(session, ends, expired)
                if ending is None:
                    done, _ = await asyncio.wait({receive, overflow}, timeout=wait_s, return_when=FIRST)
                    if receive in done:
                        break
                    if overflow in done:
                        ending = APIError(
                            400,
                            f"the client has not read {outbox.unsent} bytes of events (realtime.max_unsent_bytes): "
                            "the session is closed",
                            type="invalid_request_error",
                            code="client_not_reading",
                        )
                if ending is not None:
                    receive.cancel()
                    return ending
            message = receive.result()
            if message["type"] == "websocket.disconnect":
                return None
            raw = message.get("text")
            await session.handle(raw if raw is not None else message.get("bytes") or b"")
    except WebSocketDisconnect:
        return None
    finally:
        overflow.cancel()


def _time_left(session: Session, ends: float, expired: APIError) -> tuple[float, APIError | None]:
    """How long to wait for the client's next event, or why the session ends now: its maximum duration, or
    ``idle_timeout_s`` without a client event or a response (a client waiting for its reply is not idle)."""
    now, idle_s = time.monotonic(), session.limits.idle_timeout_s
    if now >= ends:
        return 0.0, expired
    since = session.idle_since()
    if since is None:  # a response runs: look again in idle_timeout_s
        return min(ends, now + idle_s) - now, None
    if now >= since + idle_s:
        return 0.0, APIError(
            400,
            f"no client event for {idle_s:g} s (realtime.idle_timeout_s): the session is closed",
            type="invalid_request_error",
            code="session_idle_timeout",
        )
    return min(ends, since + idle_s) - now, None


async def _close(websocket: WebSocket, outbox: Outbox, code: int, reason: str) -> None:
    """Send what is queued (the last error included) and the close frame, each within ``CLOSE_WAIT_S``: a
    client that does not read cannot hold the session open."""
    await outbox.flush(CLOSE_WAIT_S)
    await outbox.close()
    if websocket.application_state == WebSocketState.CONNECTED:
        with contextlib.suppress(Exception):  # gone, or not reading: the session ends either way
            await asyncio.wait_for(websocket.close(code, reason[:120]), CLOSE_WAIT_S)
