"""API keys: from the graph's `api_key` arg or OMNI_SERVE_API_KEY; /health stays open; 401 as an OpenAI error."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import graph_variant, wait_until

pytestmark = pytest.mark.integration

KEY = "sk-test-9f8e7d"
ENV_KEY = "sk-from-env-1234"
CHAT = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


ORIGIN = "https://app.example"
SESSION_S = 3  # realtime.max_session_minutes, in seconds: the session limit is seen to end a session
WITH_ARG_KEY = graph_variant(
    args={"api_key": KEY, "realtime": {"allowed_origins": [ORIGIN], "max_session_minutes": SESSION_S / 60}}
)
# The key only in the ingress replica's environment (the stages keep running unchanged).
WITH_ENV_KEY = graph_variant(
    deployments={"ingress": {"ray_actor_options": {"runtime_env": {"env_vars": {"OMNI_SERVE_API_KEY": ENV_KEY}}}}}
)


@pytest.fixture(scope="module")
def keyed(graphs) -> Iterator[Any]:
    graphs.deploy("tiny_omni.yaml", WITH_ARG_KEY)
    graphs.wait_healthy()
    yield graphs
    graphs.current = None  # what runs is not the plain graph: the next module redeploys it


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
        assert (await opening(subprotocols=browser, origin=ORIGIN))[0]["type"] == "session.created"
        error = await refused(subprotocols=browser, origin="https://evil.example")
        assert error["code"] == "origin_not_allowed"
        assert await official(KEY) == "session.created"
        assert await official("sk-nope") == "error"
        lasted, error, code = await expiry()
        assert error["type"] == "error" and error["error"]["code"] == "session_expired" and code == 1008
        assert SESSION_S - 1 <= lasted <= SESSION_S + 5, lasted

    asyncio.run(checks())


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
