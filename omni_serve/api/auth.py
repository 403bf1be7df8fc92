"""The API key: ``Authorization: Bearer <key>`` on every route but ``/health`` when the graph (or the env) sets one."""

from __future__ import annotations

import hmac
import os

from omni_serve.api.openai.errors import APIError


def required_key(configured: str | None) -> str | None:
    """The key requests need: the graph's (its args or the ingress's user_config), else ``OMNI_SERVE_API_KEY``'s."""
    return configured or os.environ.get("OMNI_SERVE_API_KEY") or None


def api_key_matches(authorization: str | None, api_key: str) -> bool:
    """``Authorization: Bearer <key>`` (scheme case-insensitive), compared in constant time."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def check_auth(authorization: str | None, api_key: str | None) -> None:
    """Raise 401 unless no key is set or ``authorization`` carries it."""
    if api_key is not None and not api_key_matches(authorization, api_key):
        raise APIError(401, "missing or invalid API key (Authorization: Bearer ...)", type="authentication_error")
