"""The documented Prometheus series appear on the node's metrics endpoint after real requests."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import METRICS_PORT

pytestmark = pytest.mark.integration

STAGE_SERIES = [
    "ray_omni_stage_queue_wait_seconds_bucket",
    "ray_omni_stage_processing_seconds_bucket",
    "ray_omni_stage_tokens_total",
    "ray_omni_stage_audio_seconds_total",
    "ray_omni_stage_in_flight",
    "ray_omni_stage_calls_total",
]
REQUEST_SERIES = [
    "ray_omni_request_ttft_seconds_bucket",
    "ray_omni_request_ttfa_seconds_bucket",
    "ray_omni_request_e2e_seconds_bucket",
    "ray_omni_request_rtf_bucket",
    "ray_omni_requests_total",
]


def scrape() -> str:
    return httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text


def test_stage_and_request_series_after_a_request(tiny_omni) -> None:
    body = {
        "model": "tiny-qwen3-omni",
        "messages": [{"role": "user", "content": "Hi"}],
        "modalities": ["text", "audio"],
        "max_tokens": 6,
        "stream": True,
    }
    with httpx.stream("POST", f"{tiny_omni.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert list(response.iter_lines())[-2] == "data: [DONE]"
    wanted = STAGE_SERIES + REQUEST_SERIES

    def missing(lines: list[str]) -> list[str]:
        gone = [name for name in wanted if not any(line.startswith(name) for line in lines)]
        # Serve tags stage series with the stage's deployment; requests with their route and status.
        for stage in ("thinker", "talker", "code2wav"):
            if not any(
                line.startswith("ray_omni_stage_calls_total") and f'deployment="{stage}"' in line for line in lines
            ):
                gone.append(f"calls of {stage}")
        if not any(
            "omni_requests_total" in line and 'route="chat"' in line and 'status="200"' in line for line in lines
        ):
            gone.append("chat request counted with status 200")
        return gone

    deadline = time.monotonic() + 60
    while (absent := missing(scrape().splitlines())) and time.monotonic() < deadline:
        time.sleep(1)
    assert not absent, absent
