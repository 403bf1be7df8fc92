"""Which ``Host`` a request may name, which browser ``Origin`` may act on the server, and who may serve keyless.

Rules a browser cannot get round, whatever page it runs:

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
- **Origin** (cross-site requests): a page on another site may send a server it can reach requests it
  cannot read the answers of, and some need no CORS preflight: a form posts ``multipart/form-data``,
  ``application/x-www-form-urlencoded`` or ``text/plain`` cross-site without asking, and a websocket is not
  bound by the same-origin policy at all. The 415 "say your body's type" rule (:mod:`omni_serve.api.http`)
  forces a preflight on the JSON routes only, not on the multipart ones (transcriptions, image edits,
  videos). So every request that acts, any method but ``GET``, ``HEAD`` and ``OPTIONS``, on every route,
  and the realtime websocket (:mod:`omni_serve.api.realtime.admission`) must come from a page whose
  ``Origin`` is same-origin with the request's ``Host`` (its host and port: the server's own playground)
  or listed in the graph arg ``allowed_origins`` (``*``: any); other ones get a 403 ``origin_not_allowed``
  (:class:`TrustedOrigins`), before the API key is read. ``null`` (a sandboxed page, a file, some
  redirects) is never same-origin and may not be listed. The rule reads ``Origin`` only: every browser
  sends it on a request whose method is not ``GET`` or ``HEAD``, cross-site or not (the Fetch standard),
  so a request without one is not a browser's (``curl``, the ``openai`` client) and is not concerned;
  ``Sec-Fetch-Site``, sent by the same browsers, would add nothing. ``GET`` routes read, and a page cannot
  read what they answer without a CORS grant, which this server never gives.
- **No key off loopback**: a graph Serve binds to any other address must have an API key (the graph's
  ``api_key``, or ``OMNI_SERVE_API_KEY`` in the ingress's environment), or its ingress refuses to start
  (:func:`check_exposure`), unless its ``allow_unauthenticated`` says it is open on purpose (a warning
  then, at each start). The Host rule cannot protect such a server (its names are the operator's), so
  without a key anyone who reaches the port, or a rebound page in their browser, runs the model.

One list of origins for both the HTTP requests and the websocket, the graph's ``allowed_origins``: an
origin trusted to open a session that runs the model is trusted to post a chat, and two lists would let an
operator allow a web app one way and leave it refused the other. ``realtime.allowed_origins``, where the
list lived when only the websocket was checked, is kept as another name of it (a graph or ``user_config``
that sets it keeps working; the two are joined, :class:`omni_serve.graph.config.GraphConfig`).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Collection
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from omni_serve.api.openai.errors import APIError
from omni_serve.graph.config import GraphConfigError

logger = logging.getLogger("ray.serve")

ANY = "*"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
_DEFAULT_PORTS = {"http": "80", "ws": "80", "https": "443", "wss": "443"}
READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # every other method acts (the Origin rule)


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


def host_and_port(host: str) -> tuple[str, str | None]:
    """``Host``'s name, lowercased, and its port if it names one (``[::1]:8000`` -> ``::1``, ``8000``)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest[1:] if rest.startswith(":") else None
    if host.count(":") == 1:
        name, _, port = host.partition(":")
        return name, port
    return host, None


def host_name(host: str) -> str:
    """``Host``'s name without its port, lowercased (``[::1]:8000`` -> ``::1``)."""
    return host_and_port(host)[0]


def host_allowed(host: str | None, trusted: frozenset[str] | None) -> bool:
    if trusted is None:
        return True
    name = host_name(host or "")
    return any(name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])) for pattern in trusted)


def origin_allowed(origin: str, host: str | None, allowed_origins: Collection[str]) -> bool:
    """A browser ``Origin`` is same-origin with the request's ``Host`` (name and port), or listed, or ``*`` is."""
    if ANY in allowed_origins or origin in allowed_origins:
        return True
    parts = urlsplit(origin.strip().lower())
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or not host:
        return False  # "null" (a sandboxed page, a file) or garbage: never same-origin
    # Browsers send an Origin without its scheme's default port; a Host may carry it or not (none: the default).
    default = _DEFAULT_PORTS[parts.scheme]
    port = str(parts.port) if parts.port is not None else default
    name, host_port = host_and_port(host)
    return parts.hostname == name and port == (host_port or default)


def _headers(scope: Scope, name: bytes) -> list[str]:
    return [v.decode("latin-1") for k, v in scope["headers"] if k == name]


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
        named = _headers(scope, b"host")
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


class TrustedOrigins:
    """ASGI middleware: refuse an HTTP request that acts (any method but GET, HEAD, OPTIONS) from a browser page
    whose ``Origin`` is neither same-origin with the request's ``Host`` nor listed, as a 403; a request without
    an ``Origin`` (not a browser's) passes. The websocket's Origin is realtime admission's (an error event).

    The list is the ingress's, set by :func:`configure` (at its start and at each change of its settings).
    """

    allowed: tuple[str, ...] = ()  # until configured: same-origin only

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in READ_ONLY_METHODS:
            await self.app(scope, receive, send)
            return
        origins, named = _headers(scope, b"origin"), _headers(scope, b"host")
        host = named[0] if len(named) == 1 else None
        if not origins or (len(origins) == 1 and origin_allowed(origins[0], host, TrustedOrigins.allowed)):
            await self.app(scope, receive, send)
            return
        message = (
            f"Origin '{', '.join(origins)[:80]}' may not {scope['method']} here: a page of another site "
            "(same-origin: the Origin's host and port those of the request's Host) not listed in the graph arg "
            "allowed_origins (cross-site request protection)"
        )
        error = APIError(403, message, type="invalid_request_error", code="origin_not_allowed")
        await error.response()(scope, receive, send)


def configure(bound_host: str | None, allowed_hosts: list[str] | None, allowed_origins: list[str]) -> None:
    """Set the ``Host`` names and browser ``Origin``s this process's ingress answers (by the ingress, at its start
    and at each change of its run-time settings)."""
    TrustedHosts.trusted = trusted_hosts(bound_host, allowed_hosts)
    TrustedOrigins.allowed = tuple(allowed_origins)
    if TrustedHosts.trusted is not None:
        logger.info("omni_serve: requests must name one of the hosts %s", sorted(TrustedHosts.trusted))
    if allowed_origins:
        logger.info("omni_serve: browser pages of %s may act here besides the server's own", list(allowed_origins))


def check_exposure(bound_host: str | None, has_key: bool, open_on_purpose: bool) -> None:
    """Refuse to serve where other machines reach the server (``bound_host`` not loopback) without an API key,
    unless the graph's ``allow_unauthenticated`` says so (``open_on_purpose``); then log a warning."""
    if has_key or is_loopback(bound_host):
        return
    where = f"Serve's HTTP host is {bound_host or 'every interface'} (not loopback) and the graph has no API key"
    if not open_on_purpose:
        raise GraphConfigError(
            f"omni_serve: {where}: anyone who can reach this port could run the model, so the ingress does not "
            "start. Set the graph arg api_key, or OMNI_SERVE_API_KEY in the ingress deployment's "
            "ray_actor_options.runtime_env.env_vars (or api_key in its user_config); or, to serve it open on "
            "purpose, the graph arg allow_unauthenticated: true. Put TLS in front (docs/api.md, Security)."
        )
    logger.warning(
        "omni_serve: %s; allow_unauthenticated is set, so anyone who can reach this port can run the model "
        "(docs/api.md, Security).",
        where,
    )
