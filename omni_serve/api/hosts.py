"""Which ``Host`` a request may name and which browser ``Origin`` may open a realtime session.

Two rules a browser cannot get round, whatever page it runs:

- **Host** (DNS rebinding): a page on ``evil.example`` whose name is made to resolve to 127.0.0.1 reaches a
  server on the user's machine as same-origin, but its requests still say ``Host: evil.example``. A server
  bound to a loopback address (``make serve``: Serve's ``http_options.host`` 127.0.0.1) therefore answers
  only requests naming a loopback host (``127.0.0.1``, ``localhost``, ``[::1]``, any port), with a 400;
  the graph arg ``allowed_hosts`` replaces that list (a reverse proxy that forwards its public name), ``*``
  allows any. A server bound to another address checks nothing unless ``allowed_hosts`` is set. The rule
  is Starlette's ``TrustedHostMiddleware`` (names without the port; ``*.example.com`` for subdomains), run
  as :class:`TrustedHosts` on every route and the websocket, with the list Serve's bind address decides.
  Serve binds its proxy, HAProxy's frontend and each ingress replica's own HTTP server (HAProxy mode) to
  that same ``http_options.host``, and HAProxy passes the client's ``Host`` on unchanged.
- **Origin**: a websocket is not bound by the same-origin policy, so ``/v1/realtime`` checks the ``Origin``
  a browser sends: same-origin (its host and port those of the request's ``Host``) unless
  ``realtime.allowed_origins`` lists it; ``*`` in that list allows any. Clients that are not browsers send
  no ``Origin`` and are not concerned.

HTTP POSTs need no Origin rule: every POST route takes only ``application/json`` or
``multipart/form-data`` bodies (:mod:`omni_serve.api.http`), and a cross-site ``fetch`` of JSON needs a CORS
preflight that this server never grants.
"""

from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from omni_serve.api.openai.errors import APIError

logger = logging.getLogger("ray.serve")

ANY = "*"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
_DEFAULT_PORTS = {"http": "80", "ws": "80", "https": "443", "wss": "443"}


def is_loopback(host: str | None) -> bool:
    """Whether a bind address (Serve's ``http_options.host``) is only reachable from this machine."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def trusted_hosts(bound_host: str | None, allowed_hosts: list[str] | None) -> frozenset[str] | None:
    """The host names requests may carry (None: any): ``allowed_hosts`` if set, else by the bind address."""
    if allowed_hosts is not None:
        names = frozenset(name.strip().lower() for name in allowed_hosts)
        return None if ANY in names else names
    return frozenset(LOOPBACK_NAMES) if is_loopback(bound_host) else None


def host_name(host: str) -> str:
    """``Host``'s name without its port, lowercased (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def host_allowed(host: str | None, trusted: frozenset[str] | None) -> bool:
    if trusted is None:
        return True
    name = host_name(host or "")
    return any(name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])) for pattern in trusted)


def origin_allowed(origin: str, host: str | None, allowed_origins: list[str]) -> bool:
    """A browser ``Origin`` is same-origin with the request's ``Host`` (name and port), or listed, or ``*`` is."""
    if ANY in allowed_origins or origin in allowed_origins:
        return True
    parts = urlsplit(origin.strip().lower())
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or not host:
        return False  # "null" (a sandboxed page, a file) or garbage: never same-origin
    port = str(parts.port) if parts.port is not None else _DEFAULT_PORTS[parts.scheme]
    wanted = host.strip().lower()
    # Browsers send an Origin without its scheme's default port; a Host may carry it or not.
    return parts.netloc in (wanted, f"{wanted}:{port}") or f"{parts.netloc}:{port}" == wanted


class TrustedHosts:
    """ASGI middleware: refuse a request (or websocket) whose ``Host`` is not among ``trusted``, as a 400.

    The list is the ingress's, set by :func:`configure` when it starts (one ingress per replica process;
    the FastAPI app is built at import, before the ingress knows where Serve binds).
    """

    trusted: frozenset[str] | None = frozenset(LOOPBACK_NAMES)  # until configured: the safe default

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        named = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        host = named[0] if len(named) == 1 else ", ".join(named) or None  # two Host headers: invalid, refused
        if host_allowed(host, TrustedHosts.trusted) and len(named) == 1:
            await self.app(scope, receive, send)
            return
        shown = (host or "none")[:80]
        message = f"Host '{shown}' is not allowed here (graph arg allowed_hosts; DNS rebinding protection)"
        if scope["type"] == "websocket":  # closed before the handshake: the client gets HTTP 403
            await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            return
        error = APIError(400, message, type="invalid_request_error", code="host_not_allowed")
        await error.response()(scope, receive, send)


def configure(bound_host: str | None, allowed_hosts: list[str] | None) -> None:
    """Set the ``Host`` names this process's ingress answers (called by the ingress constructor)."""
    TrustedHosts.trusted = trusted_hosts(bound_host, allowed_hosts)
    if TrustedHosts.trusted is not None:
        logger.info("omni_serve: requests must name one of the hosts %s", sorted(TrustedHosts.trusted))


def exposure_warning(bound_host: str | None, api_key: str | None) -> str | None:
    """The warning a server reachable from other machines without an API key deserves (None when it is not)."""
    if api_key is not None or is_loopback(bound_host):
        return None
    return (
        f"omni_serve: Serve's HTTP host is {bound_host or 'every interface'} (not loopback) and the graph sets no "
        "api_key: anyone who can reach this port can run the model. Set the graph arg api_key (or "
        "OMNI_SERVE_API_KEY in the ingress's environment), and put TLS in front (docs/api.md, Security)."
    )
