"""Overload: bounded stage queues answer 503/429 with Retry-After and an OpenAI error instead of queueing forever.

The graph is deployed with tiny limits (one running + one queued call per stage, per ingress
replica; the talker answers 429 via its `backpressure_config`, the thinker Serve's default 503)
and hit with more concurrent requests than fit. Some are refused with a clear error, the rest
complete in full, and the server stays healthy.
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

import httpx
import pytest

from tests.conftest import graph_variant

pytestmark = [pytest.mark.integration, pytest.mark.tiny_variant(0)]  # options only: in place

CONCURRENCY = 16
BODY = {
    "model": "tiny-qwen3-omni",
    "messages": [{"role": "user", "content": "Hello there."}],
    "modalities": ["text", "audio"],
    "max_tokens": 6,
    "stage_sampling": {"talker": {"max_tokens": 8}},
}


TINY_QUEUES = graph_variant(
    fixed_replicas=1,
    deployments={
        "thinker": {"max_ongoing_requests": 1, "max_queued_requests": 1},
        "talker": {
            "max_ongoing_requests": 1,
            "max_queued_requests": 1,
            "backpressure_config": {"status_code": 429, "retry_after_s": 2},
        },
    },
)


@pytest.fixture(scope="module")
def graph(graphs) -> Any:
    graphs.deploy("tiny_omni.yaml", TINY_QUEUES)
    graphs.wait_healthy()
    return graphs


def send(base_url: str, i: int) -> dict[str, Any]:
    stream = i % 4 == 3
    body = {**BODY, "seed": i, "stream": stream}
    with httpx.Client(timeout=150) as client:
        if not stream:
            reply = client.post(f"{base_url}/v1/chat/completions", json=body)
            return {"stream": False, "status": reply.status_code, "headers": reply.headers, "body": reply.json()}
        with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                return {
                    "stream": True,
                    "status": reply.status_code,
                    "headers": reply.headers,
                    "body": json.loads(reply.read()),
                }
            events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
        return {"stream": True, "status": 200, "headers": reply.headers, "events": events}


def check_refusal(status: int | None, headers: Any, error: dict[str, Any]) -> None:
    assert error["type"] == "overloaded_error" and error["code"] == "overloaded", error
    assert "overloaded" in error["message"] and ("'thinker'" in error["message"] or "'talker'" in error["message"])
    if headers is not None:
        assert int(headers["retry-after"]) >= 1
    if status is not None:  # each stage's own backpressure_config
        assert status == (429 if "'talker'" in error["message"] else 503), (status, error)


def test_more_requests_than_fit_are_refused_cleanly(graph) -> None:
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda i: send(graph.base_url, i), range(CONCURRENCY)))

    served = refused = 0
    for result in results:
        if result["stream"] and result["status"] == 200:
            events = result["events"]
            if events[-1] == "[DONE]":
                served += 1
                assert any('"modality":"audio"' in e for e in events)
            else:  # refused after the stream started (the talker was full): in-band error, no [DONE]
                error = json.loads(events[-1])["error"]
                check_refusal(None, None, error)  # no HTTP status of its own: the stream had started
                refused += 1
        elif result["status"] == 200:
            served += 1
            message = result["body"]["choices"][0]["message"]
            assert message["content"] and message["audio"]["data"]
        else:
            check_refusal(result["status"], result["headers"], result["body"]["error"])
            refused += 1
    print(f"{served} served, {refused} refused of {CONCURRENCY}")
    assert served + refused == CONCURRENCY
    assert refused >= 1 and served >= 1


def test_server_stays_healthy_after_overload(graph) -> None:
    assert httpx.get(f"{graph.base_url}/health", timeout=30).status_code == 200
    reply = httpx.post(f"{graph.base_url}/v1/chat/completions", json={**BODY, "seed": 1}, timeout=120)
    assert reply.status_code == 200, reply.text
