"""The tiny omni graph (transformers stages) behind Serve's HAProxy ingress: the same HTTP tests.

With ``RAY_SERVE_ENABLE_HA_PROXY=1`` HAProxy hands each request to the ingress replica's own HTTP
server, which then calls the stage deployments as behind Serve's Python proxy. The tests below are
the ones the graph passes behind the Python proxy, imported and run again in this session (see
tests/test_haproxy_ingress.py for why it is a session of its own): streamed and whole audio
replies, speech, ``/health``, a client disconnect stopping every stage, and overload refusals.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests import test_cancellation, test_overload
from tests.haproxy import served_by_ingress_replicas
from tests.test_audio_speech import (  # noqa: F401  (collected here again)
    test_openai_client,
    test_streamed_wav_arrives_in_several_chunks_and_decodes,
)
from tests.test_cancellation import graph  # noqa: F401  (fixture: one replica per stage)
from tests.test_chat_api import (  # noqa: F401  (fixture and tests collected here again)
    client,
    test_models_and_health,
    test_streaming_text_and_audio,
    test_text_and_audio_non_streaming,
)

pytestmark = [pytest.mark.haproxy, pytest.mark.integration]


def test_haproxy_sends_the_requests_to_the_ingress_replica(tiny_omni) -> None:
    body = {**test_overload.BODY, "seed": 3}
    served_by_ingress_replicas(lambda: httpx.post(f"{tiny_omni.base_url}/v1/chat/completions", json=body, timeout=120))


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_disconnect_stops_every_stage(graph, stream: bool) -> None:  # noqa: F811
    test_cancellation.test_disconnect_stops_every_stage(graph, stream)


@pytest.fixture(scope="module")
def overloaded(graphs) -> Iterator[Any]:
    """tests/test_overload.py's variant: one-deep queues, so 16 concurrent requests overflow them."""
    graphs.deploy("tiny_omni.yaml", test_overload.TINY_QUEUES)
    graphs.wait_healthy()
    yield graphs
    graphs.current = None


def test_more_requests_than_fit_are_refused_cleanly(overloaded) -> None:
    test_overload.test_more_requests_than_fit_are_refused_cleanly(overloaded)
    test_overload.test_server_stays_healthy_after_overload(overloaded)
