"""The Host and Origin rules (omni_serve.api.hosts) in process: the tables, and the middleware over a Starlette app.

The live checks (a graph Serve binds to 127.0.0.1, its routes and its websocket) are in tests/test_auth.py.
"""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from omni_serve.api import hosts
from omni_serve.api.hosts import TrustedHosts, exposure_warning, host_allowed, origin_allowed, trusted_hosts

LOOPBACK = trusted_hosts("127.0.0.1", None)


@pytest.mark.parametrize(
    ("bound", "allowed", "expected"),
    [
        ("127.0.0.1", None, {"127.0.0.1", "localhost", "::1"}),
        ("localhost", None, {"127.0.0.1", "localhost", "::1"}),
        ("::1", None, {"127.0.0.1", "localhost", "::1"}),
        ("127.0.0.2", None, {"127.0.0.1", "localhost", "::1"}),
        ("0.0.0.0", None, None),  # reachable from the network: names are the operator's (allowed_hosts)
        ("::", None, None),
        ("10.1.2.3", None, None),
        ("127.0.0.1", ["api.example", "*.cdn.example"], {"api.example", "*.cdn.example"}),
        ("0.0.0.0", ["API.example"], {"api.example"}),
        ("127.0.0.1", ["*"], None),
    ],
)
def test_the_trusted_hosts_follow_the_bind_address_unless_listed(bound, allowed, expected) -> None:
    assert trusted_hosts(bound, allowed) == (None if expected is None else frozenset(expected))


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1:8000", True),
        ("localhost:8000", True),
        ("LOCALHOST", True),
        ("[::1]:8000", True),
        ("evil.example:8000", False),  # DNS rebinding: the attacker's name, resolving to 127.0.0.1
        ("127.0.0.1.evil.example", False),
        ("", False),
        (None, False),
    ],
)
def test_a_loopback_server_answers_only_loopback_names(host, ok) -> None:
    assert host_allowed(host, LOOPBACK) is ok


def test_listed_names_and_subdomains() -> None:
    listed = trusted_hosts("127.0.0.1", ["api.example", "*.cdn.example"])
    assert host_allowed("api.example:443", listed) and host_allowed("a.cdn.example", listed)
    assert not host_allowed("cdn.example", listed) and not host_allowed("localhost:8000", listed)
    assert host_allowed("anything.at.all", trusted_hosts("0.0.0.0", None))


@pytest.mark.parametrize(
    ("origin", "host", "allowed", "ok"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", [], True),  # the playground, opened from the server
        ("https://app.example", "app.example", [], True),  # behind TLS: the default port is left out
        ("https://app.example", "app.example:443", [], True),
        ("http://app.example:80", "app.example", [], True),
        ("http://localhost:8000", "127.0.0.1:8000", [], False),  # another origin, though the same machine
        ("http://127.0.0.1:9000", "127.0.0.1:8000", [], False),  # another port is another origin
        ("https://127.0.0.1:8000", "127.0.0.1:8000", [], True),  # the scheme behind a TLS proxy is not seen
        ("https://evil.example", "127.0.0.1:8000", [], False),
        ("null", "127.0.0.1:8000", [], False),  # a sandboxed page or a file
        ("https://evil.example", None, [], False),
        ("https://app.example", "127.0.0.1:8000", ["https://app.example"], True),
        ("https://evil.example", "127.0.0.1:8000", ["https://app.example"], False),
        ("https://evil.example", "127.0.0.1:8000", ["*"], True),
    ],
)
def test_origins_are_same_origin_or_listed(origin, host, allowed, ok) -> None:
    assert origin_allowed(origin, host, allowed) is ok


async def _hello(request) -> PlainTextResponse:
    return PlainTextResponse("hello")


async def _echo(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("hello")
    await websocket.close()


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setattr(TrustedHosts, "trusted", TrustedHosts.trusted)  # restored after the test
    hosts.configure("127.0.0.1", None)
    app = Starlette(routes=[Route("/hello", _hello), WebSocketRoute("/ws", _echo)])
    app.add_middleware(TrustedHosts)
    return TestClient(app, base_url="http://127.0.0.1:8000")


def test_the_middleware_refuses_a_foreign_host_with_an_openai_error(client: TestClient) -> None:
    assert client.get("/hello").text == "hello"
    reply = client.get("/hello", headers={"host": "evil.example:8000"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "host_not_allowed" and "evil.example:8000" in error["message"]
    assert "allowed_hosts" in error["message"]


def test_two_host_headers_are_refused(client: TestClient) -> None:
    """Which one a check reads and which one a router reads may differ: a request naming two is invalid."""
    headers = [("host", "127.0.0.1:8000"), ("host", "evil.example:8000")]
    reply = client.get("/hello", headers=headers)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "host_not_allowed"


def test_the_middleware_refuses_a_foreign_hosts_websocket_before_the_handshake(client: TestClient) -> None:
    with client.websocket_connect("/ws", headers={"host": "127.0.0.1:8000"}) as ws:
        assert ws.receive_text() == "hello"
    with pytest.raises(WebSocketDisconnect) as refused:
        with client.websocket_connect("/ws", headers={"host": "evil.example:8000"}):
            pass
    assert refused.value.code == 1008


def test_the_middleware_checks_nothing_where_any_host_is_allowed(client: TestClient) -> None:
    hosts.configure("0.0.0.0", None)
    assert client.get("/hello", headers={"host": "api.example"}).text == "hello"
    hosts.configure("127.0.0.1", ["*"])
    assert client.get("/hello", headers={"host": "api.example"}).text == "hello"


def test_a_server_open_to_the_network_without_a_key_is_warned_about() -> None:
    warning = exposure_warning("0.0.0.0", None)
    assert warning is not None and "api_key" in warning and "0.0.0.0" in warning
    assert exposure_warning("0.0.0.0", "sk-1") is None
    assert exposure_warning("127.0.0.1", None) is None
