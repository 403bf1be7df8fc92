"""API keys: ``Authorization: Bearer <key>`` on every route but ``/health`` when the graph (or the env) sets one.

A key belongs to a client: the graph's ``api_keys`` (a client name -> its keys), with ``api_key`` (or, when the
graph sets no key, ``OMNI_SERVE_API_KEY``) the client ``default``'s. A request's key names the client making it
(:func:`check_auth`), and what a client owns (its video jobs) is that name's, not the key's: a client given new
keys under its name keeps what it owns. A rotation through the ingress's ``user_config``
(:mod:`omni_serve.graph.settings`) lists the old and the new key while its users move, then the new one alone.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from omni_serve.api.openai.errors import APIError
from omni_serve.graph.config import DEFAULT_CLIENT, GraphConfig

ANONYMOUS = ""  # the client of every request to a graph that sets no key


@dataclass(frozen=True)
class KeyRing:
    """Every key requests may carry, each with its client's name (never empty: no ring is ``None``)."""

    keys: tuple[tuple[str, bytes], ...]  # (client, key)

    def client(self, authorization: str | None) -> str | None:
        """The client whose key ``Authorization: Bearer <key>`` (scheme case-insensitive) carries, or None.

        Every key is compared, in constant time, whichever matches: how long it takes says nothing of which.
        """
        scheme, _, token = (authorization or "").strip().partition(" ")
        offered = token.strip().encode()
        found = None
        for client, key in self.keys:
            if hmac.compare_digest(offered, key) and found is None:
                found = client
        return found if scheme.lower() == "bearer" else None


def key_ring(graph: GraphConfig) -> KeyRing | None:
    """The keys requests need: the graph's (its args, or the ingress's user_config over them), else
    ``OMNI_SERVE_API_KEY``'s as the client ``default``'s; None when neither sets one."""
    clients = graph.clients()
    env_key = os.environ.get("OMNI_SERVE_API_KEY")
    if not clients and env_key:
        clients = {DEFAULT_CLIENT: [env_key]}
    keys = tuple((name, key.encode()) for name, keys in clients.items() for key in keys)
    return KeyRing(keys) if keys else None


def has_key(graph: GraphConfig) -> bool:
    """Whether requests to this graph need a key (the graph's or OMNI_SERVE_API_KEY)."""
    return key_ring(graph) is not None


def api_key_matches(authorization: str | None, ring: KeyRing) -> bool:
    """``Authorization: Bearer <key>`` carries a key of the ring."""
    return ring.client(authorization) is not None


def check_auth(authorization: str | None, ring: KeyRing | None) -> str:
    """The client making the request: its name in the ring (401 unless ``authorization`` carries one of its
    keys), or :data:`ANONYMOUS` when the graph sets no key."""
    if ring is None:
        return ANONYMOUS
    client = ring.client(authorization)
    if client is None:
        raise APIError(401, "missing or invalid API key (Authorization: Bearer ...)", type="authentication_error")
    return client
