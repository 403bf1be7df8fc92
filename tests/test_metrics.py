"""The documented Prometheus series move by exactly what real requests did, and count outcomes truthfully.

24 successful requests (six each of text and text+audio, streamed and not, four at a time) must add 24
``ok`` calls of the thinker, one per audio request to the talker, and no ``cancelled`` call anywhere: a stage call
that yielded its final output is complete even when the caller closes it before the stage's
generator returns. Token and audio counters grow by what the clients received.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
from typing import Any

import httpx
import pytest
import soundfile as sf

from tests.metrics import caught_up, settled, total

pytestmark = pytest.mark.integration

STAGES = ("thinker", "talker", "code2wav")
REQUESTS = 24  # six of each kind (one_request); 50 checked nothing more at twice the CPU-seconds


def one_request(base_url: str, i: int) -> dict[str, float]:
    """Request ``i`` of the mix; returns what the client received (tokens, seconds of audio)."""
    audio, stream = i % 2 == 0, i % 4 < 2
    body: dict[str, Any] = {
        "model": "tiny-qwen3-omni",
        "messages": [{"role": "user", "content": f"Hi {i}"}],
        "max_tokens": 4,
        "seed": i,
        "stream": stream,
        "modalities": ["text", "audio"] if audio else ["text"],
        "stage_sampling": {"talker": {"max_tokens": 8}},
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    with httpx.Client(timeout=120) as client:
        if not stream:
            reply = client.post(f"{base_url}/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            data = reply.json()
            pieces = [data["choices"][0]["message"]["audio"]["data"]] if audio else []
            usage = data["usage"]
        else:
            with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as reply:
                assert reply.status_code == 200
                events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            pieces = [c["choices"][0]["delta"]["audio"]["data"] for c in chunks if c.get("modality") == "audio"]
            usage = chunks[-1]["usage"]
    seconds = 0.0
    for piece in pieces:
        samples, rate = sf.read(io.BytesIO(base64.b64decode(piece)), dtype="float32")
        seconds += len(samples) / rate
    return {"audio": float(audio), "tokens": usage["completion_tokens"], "seconds": seconds}


def test_series_move_by_what_the_requests_did(tiny_omni) -> None:
    before = settled()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        received = list(pool.map(lambda i: one_request(tiny_omni.base_url, i), range(REQUESTS)))
    audio_requests = sum(r["audio"] for r in received)

    def delta(metrics: dict[str, Any], name: str, **labels: str) -> float:
        return total(metrics, name, **labels) - total(before, name, **labels)

    def counted(m: dict[str, Any]) -> Any:  # every request and every thinker/talker call, whatever its outcome
        seen = {
            "requests": delta(m, "ray_omni_requests_total", route="chat", status="200"),
            "thinker calls": delta(m, "ray_omni_stage_calls_total", deployment="thinker"),
            "talker calls": delta(m, "ray_omni_stage_calls_total", deployment="talker"),
        }
        return seen == {"requests": REQUESTS, "thinker calls": REQUESTS, "talker calls": audio_requests} or seen

    caught_up(counted)
    # Each replica reports on its own clock: the code2wav replica's last outputs can reach the endpoint a
    # report interval after the ingress's and thinker's counts did (CI saw 1.7 s of audio still missing).
    after = settled()
    outcomes = {
        f"{stage} {outcome}": delta(after, "ray_omni_stage_calls_total", deployment=stage, outcome=outcome)
        for stage in STAGES
        for outcome in ("ok", "cancelled", "error")
    }
    # Every call completed: none counted as cancelled or failed.
    assert {k: v for k, v in outcomes.items() if not k.endswith(" ok") and v} == {}, outcomes
    assert outcomes["thinker ok"] == REQUESTS and outcomes["talker ok"] == audio_requests, outcomes
    spoken = sum(r["seconds"] > 0 for r in received)  # audio requests whose talker said anything
    assert delta(after, "ray_omni_stage_calls_total", deployment="code2wav", outcome="ok") >= spoken
    assert delta(after, "ray_omni_stage_tokens_total", deployment="thinker") == sum(r["tokens"] for r in received)
    audio_s = delta(after, "ray_omni_stage_audio_seconds_total", deployment="code2wav")
    assert abs(audio_s - sum(r["seconds"] for r in received)) < 1e-3
    assert delta(after, "ray_omni_request_e2e_seconds_count", route="chat") == REQUESTS
    assert delta(after, "ray_omni_request_ttfa_seconds_count", route="chat") == spoken
    for stage in STAGES:
        assert delta(after, "ray_omni_stage_processing_seconds_count", deployment=stage) > 0
        assert delta(after, "ray_omni_stage_queue_wait_seconds_count", deployment=stage) > 0
