"""Timeouts reach the client as the API's 504 error object, never as Serve's plain-text 408 or a cut stream.

The tiny graph runs with a talker slowed by the engine's step pacing (``min_step_s`` 6 s: its first
codec chunk, one frame, comes after at least 6 s) and ``stage_timeout_s: 4``, both set in place as
run-time settings (the deployments' ``user_config``): a text+audio request fails with 504 in
OpenAI's error shape, as JSON before the response starts and as one in-band SSE event (the same
error object, no ``[DONE]``) once a stream has started. A text-only request never reaches the
talker and is unaffected. Unit checks of the layering itself: tests/test_config.py and
tests/test_orchestrator.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import HTTP_PORT, graph_variant

pytestmark = [pytest.mark.integration, pytest.mark.tiny_variant(0)]

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
STAGE_TIMEOUT_S = 4
BODY = {
    "model": "tiny-qwen3-omni",
    "messages": [{"role": "user", "content": "Hi"}],
    "modalities": ["text", "audio"],
    "max_tokens": 4,
    "stage_sampling": {"talker": {"temperature": 0.0, "max_tokens": 8}},
}


SLOW_TALKER = graph_variant(
    deployments={
        "ingress": {"user_config": {"stage_timeout_s": STAGE_TIMEOUT_S}},
        "talker": {"user_config": {"min_step_s": 6.0}},  # a minimum: the talker is silent for longer than 4 s
    }
)


@pytest.fixture(scope="module")
def graph(graphs) -> Any:
    graphs.deploy("tiny_omni.yaml", SLOW_TALKER)
    graphs.wait_healthy()
    return graphs


def test_silent_stage_gets_a_json_504(graph) -> None:
    reply = httpx.post(f"{BASE_URL}/v1/chat/completions", json=BODY, timeout=60)
    assert reply.status_code == 504, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("timeout_error", "timeout", None)
    assert "'talker'" in error["message"] and f"{STAGE_TIMEOUT_S} s" in error["message"]
    text_only = httpx.post(f"{BASE_URL}/v1/chat/completions", json={**BODY, "modalities": ["text"]}, timeout=60)
    assert text_only.status_code == 200, text_only.text


def test_stream_error_is_the_same_error_object(graph) -> None:
    with httpx.stream("POST", f"{BASE_URL}/v1/chat/completions", json={**BODY, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200  # the thinker's text started the stream
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert set(last) == {"error"}
    streamed = last["error"]
    whole = httpx.post(f"{BASE_URL}/v1/chat/completions", json=BODY, timeout=60).json()["error"]
    assert set(streamed) == set(whole) == {"message", "type", "param", "code"}
    assert {k: streamed[k] for k in ("type", "param", "code")} == {k: whole[k] for k in ("type", "param", "code")}


def test_request_deadline_answers_before_serve_does(graph) -> None:
    """Serve's per-request timeout header shortens the limit; the ingress answers 504 JSON before Serve's 408."""
    reply = httpx.post(
        f"{BASE_URL}/v1/chat/completions",
        json=BODY,
        headers={"x-request-timeout-seconds": "3.5"},  # below stage_timeout_s: the deadline binds first
        timeout=60,
    )
    assert reply.status_code == 504, reply.text
    error = reply.json()["error"]
    assert error["code"] == "timeout" and "time limit" in error["message"]
