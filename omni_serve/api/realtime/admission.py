"""Who may open a session on this replica: the API key, the browser's Origin, the model, and room.

A refused connection is accepted first and gets one ``error`` event saying why, then a close (1008
for a rule it broke, 1013 "try again later" for a full replica), so a client reads the reason
instead of a bare failed handshake.

Room: a replica holds at most ``realtime.max_sessions`` sessions, one client at most
``realtime.max_sessions_per_client`` of them (:func:`client_of`). Serve counts each open websocket
as one of the ingress's ``max_ongoing_requests`` for its whole life, idle or not (a websocket is one
ASGI call), so sessions and HTTP requests share that bound; ``max_sessions`` below it keeps room for
HTTP requests on the replica.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from starlette.websockets import WebSocket

from omni_serve.api.auth import KeyRing, api_key_matches
from omni_serve.api.hosts import origin_allowed
from omni_serve.api.openai.errors import APIError
from omni_serve.graph.config import RealtimeConfig

# Browsers cannot set headers on a websocket: OpenAI's browser SDK sends the key as a subprotocol.
KEY_PROTOCOL = "openai-insecure-api-key."
POLICY_VIOLATION = 1008  # RFC 6455: the close code for a session that broke a rule (auth, limits)
TRY_AGAIN_LATER = 1013  # RFC 6455 (IANA registry): the server is overloaded


class OpenSession(Protocol):
    """What the replica's accounts read of an open session."""

    def held_bytes(self) -> int: ...

    def pending_transcriptions(self) -> int: ...


class Sessions:
    """The sessions one ingress replica holds (the room they take, and what tests and operators read of them)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open: dict[OpenSession, Callable[[], int]] = {}  # each open session -> the bytes its client has not taken
        self.clients: Counter[str] = Counter()  # each client (client_of) -> its open sessions

    def add(self, session: OpenSession, client: str, unsent: Callable[[], int]) -> None:
        self.open[session] = unsent
        self.clients[client] += 1

    def remove(self, session: OpenSession, client: str) -> None:
        if self.open.pop(session, None) is not None:
            self.clients[client] -= 1
            if not self.clients[client]:
                del self.clients[client]

    def over_quota(self, client: str, per_client: int | None) -> APIError | None:
        """Why ``client`` may not open one more session: it holds ``per_client`` already (or None)."""
        if per_client is None or self.clients[client] < per_client:
            return None
        return APIError(
            429,
            f"this client holds {per_client} sessions on this replica (realtime.max_sessions_per_client): "
            "end one first",
            type="rate_limit_error",
            code="too_many_client_sessions",
        )

    def full(self) -> APIError | None:
        if len(self.open) < self.limit:
            return None
        return APIError(
            503,
            f"this server holds {self.limit} sessions per replica (realtime.max_sessions): try again later",
            type="server_error",
            code="too_many_sessions",
        )

    def stats(self) -> dict[str, Any]:
        """Per open session: the bytes it holds, the bytes its client has not taken, its pending transcriptions;
        per client (:func:`client_of`), the sessions it holds."""
        return {
            "sessions": len(self.open),
            "clients": dict(sorted(self.clients.items())),
            "held_bytes": sorted(s.held_bytes() for s in self.open),
            "unsent_bytes": sorted(unsent() for unsent in self.open.values()),
            "pending_transcriptions": sorted(s.pending_transcriptions() for s in self.open),
        }


def client_of(websocket: WebSocket, ring: KeyRing | None) -> str:
    """Who opens the session, for ``max_sessions_per_client``: the peer's address (its host: one client's
    connections come from many ports) and, when the graph sets keys, the client its key names: clients behind
    one address with keys of their own are told apart, and one key shared by many does not make them one.

    The address is the one the replica's server gives: behind Serve's HAProxy, the client's own, which the
    HAProxy ``omni_serve.cli.run`` starts writes into X-Forwarded-For (``cli/haproxy_loopback.sh``) and the
    replica's uvicorn takes from a loopback peer (its ``FORWARDED_ALLOW_IPS`` default); docs/realtime.md says
    who a client is where that does not hold (Serve's own HAProxy, another node's, a load balancer)."""
    host = websocket.client.host if websocket.client is not None else ""
    if ring is None:
        return host
    protocols = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",")]
    offered = [websocket.headers.get("authorization") or ""]
    offered += [f"Bearer {p[len(KEY_PROTOCOL) :]}" for p in protocols if p.startswith(KEY_PROTOCOL)]
    name = next((n for n in map(ring.client, offered) if n is not None), "")  # "": refused by its key anyway
    return f"{host} {name}"


def refusal(
    websocket: WebSocket, model: str, limits: RealtimeConfig, api_key: KeyRing | None, unavailable: str | None = None
) -> APIError | None:
    """Why this connection may not open a session to the graph serving ``model`` (auth, Origin, model), or None.

    ``unavailable``: why the graph runs no sessions at all (its routes), or None.
    """
    protocols = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    if api_key is not None:
        offered = [p[len(KEY_PROTOCOL) :] for p in protocols if p.startswith(KEY_PROTOCOL)]
        header = websocket.headers.get("authorization")
        if not api_key_matches(header, api_key) and not any(api_key_matches(f"Bearer {k}", api_key) for k in offered):
            return APIError(
                401,
                f"missing or invalid API key (Authorization: Bearer ..., or the subprotocol {KEY_PROTOCOL}<key>)",
                type="authentication_error",
                code="invalid_api_key",
            )
    origin = websocket.headers.get("origin")
    if origin is not None and not origin_allowed(origin, websocket.headers.get("host"), limits.allowed_origins):
        message = f"origin {origin[:80]!r} is neither this server's nor listed in realtime.allowed_origins"
        return APIError(403, message, type="invalid_request_error", code="origin_not_allowed")
    if unavailable is not None:
        return APIError(400, unavailable, type="invalid_request_error", param="model", code="unsupported_route")
    asked = websocket.query_params.get("model")
    if asked is not None and asked != model:
        return APIError(
            404,
            f"model '{asked}' does not exist; this server serves '{model}'",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )
    return None
