"""The Host, Origin and key rules (omni_serve.api.hosts) in process: the tables, and the middlewares over a Starlette
app.

The same rules in the real ingress app: tests/test_ingress_security.py. The live checks (a graph Serve binds to
127.0.0.1, its routes and its websocket) are in tests/test_auth.py.
"""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from omni_serve.api import hosts
from omni_serve.api.hosts import (
    TrustedHosts,
    TrustedOrigins,
    check_exposure,
    host_allowed,
    origin_allowed,
    trusted_hosts,
)
from omni_serve.graph.config import GraphConfigError

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
        ("http://127.0.0.1:9000", "127.0.0.1", [], False),  # a Host without a port: the default one (80)
        ("http://127.0.0.1:80", "127.0.0.1", [], True),
        ("http://[::1]:8000", "[::1]:8000", [], True),
        ("http://[::1]:9000", "[::1]:8000", [], False),
        ("http://[::1]", "[::1]", [], True),
        ("http://127.0.0.1:8000", "127.0.0.1:8000:8000", [], False),  # garbage
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


async def _hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


async def _acted(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"{request.method} {len(await request.body())}")


async def _echo(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("hello")
    await websocket.close()


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setattr(TrustedHosts, "trusted", TrustedHosts.trusted)  # restored after the test
    monkeypatch.setattr(TrustedOrigins, "allowed", TrustedOrigins.allowed)
    hosts.configure("127.0.0.1", None, [])
    acts = Route("/act", _acted, methods=["GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"])
    app = Starlette(routes=[Route("/hello", _hello), acts, WebSocketRoute("/ws", _echo)])
    app.add_middleware(TrustedOrigins)
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
    hosts.configure("0.0.0.0", None, [])
    assert client.get("/hello", headers={"host": "api.example"}).text == "hello"
    hosts.configure("127.0.0.1", ["*"], [])
    assert client.get("/hello", headers={"host": "api.example"}).text == "hello"


SAME = "http://127.0.0.1:8000"  # the server's own pages (the playground): same-origin with the client's Host
FORM = {"files": {"file": ("a.wav", b"RIFF....", "audio/wav")}, "data": {"model": "m"}}  # multipart/form-data


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.parametrize("origin", ["https://evil.example", "http://127.0.0.1:9000", "http://localhost:8000", "null"])
def test_a_foreign_page_may_not_act(client: TestClient, method: str, origin: str) -> None:
    """Whatever the body (a form needs no CORS preflight): 403 before the app runs."""
    reply = client.request(method, "/act", headers={"origin": origin}, **(FORM if method == "POST" else {}))
    assert reply.status_code == 403, reply.text
    error = reply.json()["error"]
    assert error["code"] == "origin_not_allowed" and error["type"] == "invalid_request_error"
    assert origin in error["message"] and "allowed_origins" in error["message"] and method in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        FORM,
        {"json": {"model": "m"}},
        {"content": b"model=m", "headers": {"content-type": "application/x-www-form-urlencoded"}},
        {"content": b"{}", "headers": {"content-type": "text/plain"}},
    ],
    ids=["multipart", "json", "urlencoded", "text"],
)
def test_the_rule_is_the_same_for_every_body(client: TestClient, body: dict) -> None:
    headers = body.get("headers", {})
    rest = {k: v for k, v in body.items() if k != "headers"}
    assert client.post("/act", headers={**headers, "origin": "https://evil.example"}, **rest).status_code == 403
    assert client.post("/act", headers={**headers, "origin": SAME}, **rest).status_code == 200


def test_the_servers_own_pages_clients_without_an_origin_and_reads_are_not_concerned(client: TestClient) -> None:
    assert client.post("/act", headers={"origin": SAME}, **FORM).text.startswith("POST ")
    assert client.delete("/act", headers={"origin": SAME}).text == "DELETE 0"
    assert client.post("/act", **FORM).status_code == 200  # curl, the openai client: no Origin
    for method in ("GET", "HEAD", "OPTIONS"):  # reads: a foreign page cannot see what they answer
        assert client.request(method, "/act", headers={"origin": "https://evil.example"}).status_code == 200
    foreign = {"host": "127.0.0.1:8000", "origin": "https://evil.example"}
    with client.websocket_connect("/ws", headers=foreign) as ws:  # the websocket's Origin: realtime admission's
        assert ws.receive_text() == "hello"


def test_listed_origins_and_any(client: TestClient) -> None:
    hosts.configure("127.0.0.1", None, ["https://app.example"])
    assert client.post("/act", headers={"origin": "https://app.example"}, **FORM).status_code == 200
    assert client.post("/act", headers={"origin": "https://evil.example"}, **FORM).status_code == 403
    hosts.configure("127.0.0.1", None, ["*"])
    assert client.post("/act", headers={"origin": "https://evil.example"}, **FORM).status_code == 200


def test_two_origin_headers_are_refused(client: TestClient) -> None:
    reply = client.post("/act", headers=[("origin", SAME), ("origin", "https://evil.example")], **FORM)
    assert reply.status_code == 403 and reply.json()["error"]["code"] == "origin_not_allowed"


@pytest.mark.parametrize("bound", ["0.0.0.0", "::", "10.1.2.3", None])
def test_a_server_open_to_the_network_needs_a_key(bound: str | None) -> None:
    with pytest.raises(GraphConfigError) as refused:
        check_exposure(bound, has_key=False, open_on_purpose=False)
    message = str(refused.value)
    assert "does not start" in message and "api_key" in message and "OMNI_SERVE_API_KEY" in message
    assert "allow_unauthenticated" in message and (bound or "every interface") in message


def test_a_key_a_loopback_bind_or_the_open_setting_lets_it_start(monkeypatch: pytest.MonkeyPatch) -> None:
    warned: list[str] = []  # Serve's logger may not propagate to pytest's capture: its warnings, taken here
    monkeypatch.setattr(hosts.logger, "warning", lambda message, *args: warned.append(message % args))
    check_exposure("0.0.0.0", has_key=True, open_on_purpose=False)
    check_exposure("127.0.0.1", has_key=False, open_on_purpose=False)
    assert not warned
    check_exposure("0.0.0.0", has_key=False, open_on_purpose=True)  # open on purpose: said at every start
    [warning] = warned
    assert "allow_unauthenticated is set" in warning and "0.0.0.0" in warning
