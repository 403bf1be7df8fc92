"""A client that disconnects mid-request stops the work in every stage it reached (streaming and not).

The talker is asked for 4000 greedy codec frames (greedy decoding of the tiny random talker never
samples codec EOS, so the request would otherwise run for minutes and make ~160 code2wav calls).
The client hangs up once the request is in the talker and code2wav; afterwards every engine must
drain (`running` and `waiting` back to 0), code2wav must stop receiving calls, and it must have
seen only a small fraction of the calls the full request would have made.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests import graph_properties
from tests.conftest import one_replica_per_stage, wait_until
from tests.families import BY_NAME
from tests.in_flight import (
    BODY,
    TALKER_FRAMES,
    idle,
    open_request,
    stats,
)

pytestmark = pytest.mark.integration

FULL_CHUNKS = TALKER_FRAMES // 25  # code2wav calls the uncancelled request would make


@pytest.fixture(scope="module")
def graph(tiny_omni: Any) -> Any:
    return one_replica_per_stage(tiny_omni)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_disconnect_stops_every_stage(graph, stream: bool) -> None:
    wait_until(lambda: idle(graph), 90, "idle stages before the test")
    before = stats(graph)
    sock = open_request(graph.base_url, stream)
    try:

        def in_talker_and_code2wav() -> bool:
            now = stats(graph)
            return (
                now["talker"]["running"] == 1
                and now["code2wav"]["requests_total"] > before["code2wav"]["requests_total"]
            )

        wait_until(in_talker_and_code2wav, 90, "the request to reach the talker and code2wav")
        if stream:  # the client really is reading the stream when it leaves
            received = sock.recv(65536)
            assert received.startswith(b"HTTP/1.1 200") and b"data: " in received
    finally:
        sock.close()

    wait_until(lambda: idle(graph), 90, "every stage to drop the request after the disconnect")
    settled = stats(graph)["code2wav"]["requests_total"]
    time.sleep(2)
    after = stats(graph)
    assert after["code2wav"]["requests_total"] == settled, "code2wav still receives chunks of a cancelled request"
    assert after["talker"]["requests_total"] == before["talker"]["requests_total"] + 1
    assert after["thinker"]["requests_total"] == before["thinker"]["requests_total"] + 1
    made = settled - before["code2wav"]["requests_total"]
    assert 1 <= made < FULL_CHUNKS // 2, f"{made} code2wav calls: the talker was not aborted early"


def test_graph_serves_normally_after_cancellations(graph) -> None:
    import httpx

    body = {**BODY, "stage_sampling": {"talker": {"max_tokens": 8}}}
    reply = httpx.post(f"{graph.base_url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["audio"]["data"]


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph, check) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph."""
    check(graph, BY_NAME["transformers"])
