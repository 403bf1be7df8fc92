"""API keys: from the graph (its `api_key` arg, or the ingress's `user_config`, changed in place) or
OMNI_SERVE_API_KEY; /health stays open; 401 as an OpenAI error.

The key and the realtime limits are set here as run-time settings (omni_serve.graph.settings): deployed
over the running tiny graph, they reach its replicas without restarting one, and removing them restores
the args' (no key). The `api_key` arg itself is tested on the image graph (tests/test_playground.py).

Also the rest of the front door on the same keyed graph (one deploy): every route and the websocket
need the key, a foreign ``Host`` is refused on a loopback server (DNS rebinding), a POST must say its
body's type, a browser page of another site may not post (a form or JSON), and a browser's realtime session
must be same-origin or listed.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import HTTP_PORT, graph_variant, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.tiny_variant(0)]

KEY = "sk-test-9f8e7d"
ENV_KEY = "sk-from-env-1234"
CHAT = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


ORIGIN = "https://app.example"
SESSION_S = 3  # realtime.max_session_minutes, in seconds: the session limit is seen to end a session
REALTIME = {"allowed_origins": [ORIGIN], "max_session_minutes": SESSION_S / 60}
WITH_KEY = graph_variant(deployments={"ingress": {"user_config": {"api_key": KEY, "realtime": REALTIME}}})
# The key only in the ingress replica's environment (the stages keep running unchanged).
WITH_ENV_KEY = graph_variant(
    deployments={"ingress": {"ray_actor_options": {"runtime_env": {"env_vars": {"OMNI_SERVE_API_KEY": ENV_KEY}}}}}
)


@pytest.fixture(scope="module")
def unkeyed_replicas(graphs) -> dict[str, set[str]]:
    """The replicas of the tiny graph as it runs before the key is set."""
    graphs.ensure("tiny_omni.yaml")
    return graphs.replicas()


@pytest.fixture(scope="module")
def keyed(graphs, unkeyed_replicas) -> Any:
    graphs.deploy("tiny_omni.yaml", WITH_KEY)
    graphs.wait_healthy()
    return graphs


def test_the_key_is_set_without_restarting_a_replica(keyed, unkeyed_replicas) -> None:
    assert keyed.replicas() == unkeyed_replicas
    assert_401(httpx.get(f"{keyed.base_url}/v1/models", timeout=30))


def assert_401(reply: httpx.Response) -> None:
    assert reply.status_code == 401, reply.text
    error = reply.json()["error"]
    assert error["type"] == "authentication_error" and "API key" in error["message"]
    assert KEY not in reply.text


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Bearer {KEY}x"},
        {"authorization": f"Bearer {KEY[:-1]}"},
        {"authorization": f"Basic {KEY}"},
        {"authorization": KEY},
        {"authorization": "Bearer"},
        {"x-api-key": KEY},
    ],
    ids=["missing", "wrong", "longer", "prefix", "basic-scheme", "no-scheme", "empty-token", "other-header"],
)
def test_wrong_or_missing_key_is_401(keyed, headers: dict[str, str]) -> None:
    base = keyed.base_url
    assert_401(httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=headers, timeout=30))
    assert_401(httpx.get(f"{base}/v1/models", headers=headers, timeout=30))
    # Auth comes before parsing: a bad body from an unauthenticated client still learns nothing.
    assert_401(httpx.post(f"{base}/v1/chat/completions", content=b"{", headers=headers, timeout=30))


# The routes anyone may reach: the readiness probe, and the playground page (a person types the key into it).
OPEN = {
    ("GET", "/health"),
    ("GET", "/"),
    ("GET", "/playground/"),
    ("GET", "/playground/info"),
    ("GET", "/playground/{name}"),
}


def ingress_routes() -> set[tuple[str, str]]:
    """(method, path) of every route of the ingress's FastAPI app ("WS" for a websocket), mounts included."""
    from starlette.routing import Mount, WebSocketRoute

    from omni_serve.api.ingress import api

    found: set[tuple[str, str]] = set()

    def walk(routes: Any, prefix: str) -> None:
        for route in routes:
            if isinstance(route, Mount):
                walk(route.routes, prefix + route.path)
            elif hasattr(route, "original_router"):  # FastAPI's lazily included router (the ingress class's routes)
                walk(route.original_router.routes, prefix)
            elif isinstance(route, WebSocketRoute) or type(route).__name__ == "APIWebSocketRoute":
                found.add(("WS", prefix + route.path))
            else:
                found.update((method, prefix + route.path) for method in route.methods - {"HEAD"})

    walk(api.routes, "")
    # The helper sees the class's routes too (a FastAPI that hid them would make the test below vacuous).
    assert {("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("WS", "/v1/realtime")} <= found, found
    return found


def test_every_route_but_health_and_the_playground_page_needs_the_key(keyed) -> None:
    """Every HTTP route of the app is asked without a key (the websocket's refusals: the realtime test below)."""
    base = keyed.base_url
    routes = ingress_routes()
    guarded = sorted((method, path) for method, path in routes - OPEN if method != "WS")
    assert len(guarded) >= 7, guarded  # models, voices, stages, chat, transcriptions, speech, images
    for method, path in guarded:
        assert_401(httpx.request(method, f"{base}{path}", json={}, timeout=30))
    for method, path in OPEN & routes:
        url = f"{base}{path.replace('{name}', 'playground.js')}"
        assert httpx.request(method, url, timeout=30).status_code in (200, 307), (method, path)


def test_a_post_must_say_its_body_is_json_or_a_form(keyed) -> None:
    """A body without a Content-Type is 415 on every POST route: a cross-site page could otherwise send it
    without a CORS preflight (fetch's text/plain and a form's types need none)."""
    base, key = keyed.base_url, {"authorization": f"Bearer {KEY}"}
    posts = sorted(path for method, path in ingress_routes() if method == "POST")
    assert len(posts) >= 4, posts
    for path in posts:
        for content_type in (None, "text/plain"):
            headers = key if content_type is None else {**key, "content-type": content_type}
            reply = httpx.post(f"{base}{path}", content=json.dumps(CHAT).encode(), headers=headers, timeout=30)
            assert reply.status_code == 415, (path, content_type, reply.text)
            assert "Content-Type must be" in reply.json()["error"]["message"]


def test_a_loopback_server_refuses_a_foreign_host(keyed) -> None:
    """DNS rebinding: a page on evil.example, its name resolving to 127.0.0.1, still sends Host: evil.example."""
    import websockets
    from websockets.exceptions import InvalidStatus

    base, key = keyed.base_url, {"authorization": f"Bearer {KEY}"}
    for path in ("/v1/models", "/health", "/playground/"):
        reply = httpx.get(f"{base}{path}", headers={**key, "host": f"evil.example:{HTTP_PORT}"}, timeout=30)
        assert reply.status_code == 400, (path, reply.text)
        assert reply.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{HTTP_PORT}", f"127.0.0.1:{HTTP_PORT}"):
        assert httpx.get(f"{base}/v1/models", headers={**key, "host": host}, timeout=30).status_code == 200

    async def websocket(host: str) -> None:
        # Connected to this server, the handshake naming ``host`` (as a rebound name would: its only Host header).
        url = f"ws://{host}/v1/realtime"
        async with websockets.connect(url, host="127.0.0.1", port=HTTP_PORT, additional_headers=key) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"

    with pytest.raises(InvalidStatus) as refused:
        asyncio.run(websocket(f"evil.example:{HTTP_PORT}"))
    assert refused.value.response.status_code == 403
    asyncio.run(websocket(f"localhost:{HTTP_PORT}"))


def test_a_page_of_another_site_may_not_post_a_form_or_json(keyed) -> None:
    """Cross-site forms: a page posts multipart/form-data anywhere without a CORS preflight, so a POST carrying a
    foreign browser Origin is 403 on every route (before the key is read); the server's own pages (the
    playground) and clients that send no Origin get the route's answer (omni_serve.api.hosts)."""
    import io

    import numpy as np
    import soundfile as sf

    from tests.audio import spoken

    wav = io.BytesIO()
    sf.write(wav, np.frombuffer(spoken("Hello there."), "<i2"), 24000, format="WAV", subtype="PCM_16")
    base, key = keyed.base_url, {"authorization": f"Bearer {KEY}"}

    def transcribe(headers: dict[str, str]) -> httpx.Response:
        form = {"file": ("hello.wav", wav.getvalue(), "audio/wav")}
        url = f"{base}/v1/audio/transcriptions"
        return httpx.post(url, files=form, data={"model": "tiny-qwen3-omni"}, headers=headers, timeout=120)

    speech = {"model": "tiny-qwen3-omni", "input": "Hi", "response_format": "wav"}
    for origin in ("https://evil.example", f"http://127.0.0.1:{HTTP_PORT + 7}", "null"):
        for headers in ({**key, "origin": origin}, {"origin": origin}):
            replies = [
                transcribe(headers),
                httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=headers, timeout=30),
                httpx.post(f"{base}/v1/audio/speech", json=speech, headers=headers, timeout=30),
            ]
            for reply in replies:
                assert reply.status_code == 403, (origin, reply.request.url, reply.text)
                assert reply.json()["error"]["code"] == "origin_not_allowed"
    own = {**key, "origin": f"http://127.0.0.1:{HTTP_PORT}"}
    for headers in (own, key):  # the playground's page; curl and the openai client send no Origin
        reply = transcribe(headers)
        assert reply.status_code == 200 and reply.json()["text"], reply.text
        chat = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
        assert chat.status_code == 200, chat.text
    listed = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers={**key, "origin": ORIGIN}, timeout=60)
    assert listed.status_code == 200, listed.text  # realtime.allowed_origins: the one list, for every route


def test_health_stays_open(keyed) -> None:
    assert httpx.get(f"{keyed.base_url}/health", timeout=30).status_code == 200


def test_right_key_works_with_the_openai_client(keyed) -> None:
    client = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["tiny-qwen3-omni"]
    reply = client.chat.completions.create(**CHAT, seed=1)
    assert reply.choices[0].message.content
    # The scheme is case-insensitive (RFC 9110).
    lower = httpx.get(f"{keyed.base_url}/v1/models", headers={"authorization": f"bearer {KEY}"}, timeout=30)
    assert lower.status_code == 200


def test_wrong_key_raises_authentication_error_in_the_openai_client(keyed) -> None:
    client = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="sk-nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(**CHAT)
    assert info.value.status_code == 401


def test_realtime_sessions_need_the_key_and_an_allowed_origin(keyed) -> None:
    """Bearer header or the browser SDK's subprotocol; refusals are an error event, then close 1008."""
    import websockets
    from websockets.exceptions import ConnectionClosed

    url = f"{keyed.base_url.replace('http', 'ws', 1)}/v1/realtime?model=tiny-qwen3-omni"
    bearer = {"additional_headers": {"authorization": f"Bearer {KEY}"}}

    async def opening(**options: Any) -> tuple[dict[str, Any], int | None, str | None]:
        """The first event, and the close (code, reason) if the server closes within the session limit."""
        async with websockets.connect(url, **options) as ws:
            first = json.loads(await ws.recv())
            assert ws.subprotocol == ("realtime" if "subprotocols" in options else None)
            if first["type"] == "session.created":
                return first, None, None
            try:
                await asyncio.wait_for(ws.recv(), 10)
            except ConnectionClosed as closed:
                assert closed.rcvd is not None
                return first, closed.rcvd.code, closed.rcvd.reason
            raise AssertionError("a refused session was not closed")

    async def refused(**options: Any) -> dict[str, Any]:
        first, code, reason = await opening(**options)
        assert first["type"] == "error" and code == 1008 and reason, (first, code)
        assert KEY not in json.dumps(first) + (reason or "")
        return first["error"]

    async def expiry() -> tuple[float, dict[str, Any], int]:
        async with websockets.connect(url, **bearer) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            start = time.monotonic()
            error = json.loads(await ws.recv())
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd is not None
            return time.monotonic() - start, error, closed.value.rcvd.code

    async def official(api_key: str) -> str:
        client = openai.AsyncOpenAI(base_url=f"{keyed.base_url}/v1", api_key=api_key, max_retries=0)
        async with client.realtime.connect(model="tiny-qwen3-omni") as conn:
            return (await conn.recv()).type

    async def checks() -> None:
        for options in ({}, {"additional_headers": {"authorization": "Bearer wrong"}}, {"subprotocols": ["realtime"]}):
            assert (await refused(**options))["type"] == "authentication_error"
        wrong = ["realtime", "openai-insecure-api-key.wrong"]
        assert (await refused(subprotocols=wrong))["code"] == "invalid_api_key"
        assert (await opening(**bearer))[0]["type"] == "session.created"
        browser = ["realtime", f"openai-insecure-api-key.{KEY}"]
        assert (await opening(subprotocols=browser))[0]["type"] == "session.created"
        assert (await opening(subprotocols=browser, origin=ORIGIN))[0]["type"] == "session.created"  # listed
        same = f"http://127.0.0.1:{HTTP_PORT}"  # the server's own origin (its playground): allowed by default
        assert (await opening(subprotocols=browser, origin=same))[0]["type"] == "session.created"
        for foreign in ("https://evil.example", f"http://127.0.0.1:{HTTP_PORT + 7}", "null"):
            error = await refused(subprotocols=browser, origin=foreign)
            assert error["code"] == "origin_not_allowed", foreign
        assert await official(KEY) == "session.created"
        assert await official("sk-nope") == "error"
        lasted, error, code = await expiry()
        assert error["type"] == "error" and error["error"]["code"] == "session_expired" and code == 1008
        assert SESSION_S - 1 <= lasted <= SESSION_S + 5, lasted

    asyncio.run(checks())


def test_a_key_removed_from_the_user_config_is_no_longer_needed(keyed, unkeyed_replicas) -> None:
    """The graph without its user_config: back to the args' settings (no key), on the same replicas."""
    keyed.deploy("tiny_omni.yaml")
    keyed.wait_healthy()
    assert httpx.get(f"{keyed.base_url}/v1/models", timeout=30).status_code == 200
    assert keyed.replicas() == unkeyed_replicas


def test_key_from_the_environment(keyed) -> None:
    keyed.deploy("tiny_omni.yaml", WITH_ENV_KEY)
    keyed.wait_healthy()
    base = keyed.base_url
    wait_until(  # until the replaced ingress replica answers
        lambda: httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {ENV_KEY}"}, timeout=30).is_success,
        120,
        "the ingress to pick up OMNI_SERVE_API_KEY",
        interval_s=0.5,
    )
    assert_401(httpx.get(f"{base}/v1/models", timeout=30))
    assert_401(httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=30))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=ENV_KEY, max_retries=0, timeout=60)
    assert client.chat.completions.create(**CHAT, seed=2).choices[0].message.content
