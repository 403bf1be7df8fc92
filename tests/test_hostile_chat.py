"""Hostile chat clients on the tiny omni graph: clients that leave at every stage of a streamed audio reply,
and one that never reads it. (A realtime barge-in's walk is tested in process, in
tests/test_streamed_handoffs.py; the realtime abuse cases belong with the Realtime API's own suite.)

Each leaves nothing behind (no stage call or engine request running, no streamed-handoff channel or
flow-control window open, no object left in the object stores, no ``/dev/shm`` segment, the ingress
replica's memory back within a margin) and harms nobody: a seeded victim request on the same ingress
replica gets, byte for byte, the reply it gets alone. The probes are tests/hostile.py's.

The talker is asked for 4000 greedy codec frames (the tiny random talker never samples codec EOS
greedily), so every reply is still running when its client leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests import hostile
from tests.conftest import one_replica_per_stage, wait_until

pytestmark = pytest.mark.integration

LONG = {
    "model": "tiny-qwen3-omni",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "ethan", "format": "pcm16"},
    "stream": True,
    "max_tokens": 24,
    "seed": 7,
    "stage_sampling": {"thinker": {"ignore_eos": True}, "talker": {"temperature": 0.0, "max_tokens": 4000}},
}
VICTIM = {
    "model": "tiny-qwen3-omni",
    "messages": [{"role": "user", "content": "Say hello."}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "chelsie", "format": "pcm16"},
    "stream": True,
    "max_tokens": 12,
    "seed": 11,
    "stage_sampling": {"talker": {"seed": 11, "max_tokens": 32}},
}
RSS_MARGIN = 64 << 20  # the ingress's allocator keeps some of what a request used; a leak of chunks grows past it


@pytest.fixture(scope="module")
def graph(tiny_omni: Any) -> Any:
    return one_replica_per_stage(tiny_omni)


@pytest.fixture(scope="module")
def victim(graph: Any) -> hostile.Victim:
    return hostile.Victim(graph.base_url, VICTIM)


def settled(graph: Any, census: hostile.Census) -> dict[str, Any]:
    """What the abuse left once the graph is idle again and the object stores have freed what they will."""
    wait_until(lambda: hostile.idle(graph), 120, lambda: f"idle stages (now {hostile.stage_stats(graph)})")

    def clean() -> dict[str, Any] | None:
        left = census.left()
        gone = left["objects_bytes"] == 0 and not left["shm"] and left["channels_and_windows"] == (0, 0)
        return left if gone else None

    wait_until(clean, 30, lambda: f"everything the request held freed (left: {census.left()})")
    return census.left()


LEAVE_AT: dict[str, Callable[[hostile.RawClient, Any], None]] = {
    # Before the first byte of the reply: the thinker runs, the client has read nothing.
    "before-the-first-byte": lambda client, graph: wait_until(
        lambda: hostile.stage_stats(graph)["thinker"]["in_flight"] == 1, 60, "the thinker's call"
    ),
    # On the first text delta: the talker's streamed call has just been given its first chunk.
    "after-the-first-text-delta": lambda client, graph: client.read_until(hostile.text_delta),
    "after-the-first-audio-chunk": lambda client, graph: client.read_until(hostile.audio_delta),
    "mid-stream": lambda client, graph: [client.read_until(hostile.audio_delta) for _ in range(3)],
}


@pytest.mark.parametrize("leave_at", list(LEAVE_AT))
def test_a_client_that_leaves_leaves_nothing_behind(graph: Any, victim: hostile.Victim, leave_at: str) -> None:
    wait_until(lambda: hostile.idle(graph), 120, "idle stages before the test")
    census = hostile.Census(graph.address)
    before = hostile.stage_stats(graph)
    client = hostile.RawClient(graph.base_url, LONG)
    try:
        LEAVE_AT[leave_at](client, graph)
    finally:
        client.close()
    left = settled(graph, census)
    assert left["rss_growth"] < RSS_MARGIN, left
    after = hostile.stage_stats(graph)
    # Every stage call the request started ended: finished, or aborted by its engine (none still running).
    for stage in hostile.STAGES:
        started = after[stage]["requests_total"] - before[stage]["requests_total"]
        assert after[stage]["stream_calls"] == 0, (stage, after[stage])
        assert started <= {"thinker": 1, "talker": 1}.get(stage, started), (stage, started)
    # The talker call the request started ended (stream_calls 0 above): aborted, or finished at the talker's
    # context, which caps its 4000 frames (it sizes its rows by its context, not max_tokens) and which a
    # client leaving on its first text delta may not outlast. The abort itself: the audio leave points below.
    talked = after["talker"]["calls"] - before["talker"]["calls"]
    aborted = after["talker"]["aborted"] - before["talker"]["aborted"]
    assert aborted <= talked <= 1, (before["talker"], after["talker"])
    if leave_at in ("after-the-first-audio-chunk", "mid-stream"):
        assert talked == 1
    victim.unharmed()


def test_a_client_that_never_reads_its_streamed_audio_reply(graph: Any, victim: hostile.Victim) -> None:
    """It sends its request and reads nothing, not even the status line. Behind Serve's Python proxy (this
    session's) the ingress hands the body to Serve, which queues it for the client without bound (Serve
    2.60: docs/design.md, "Flow control"): the reply runs to its end and the proxy holds it. The ingress
    holds no more than its bound meanwhile, a victim is served as if alone, and once the client leaves
    nothing is left."""
    body = {
        **LONG,
        "stage_sampling": {"thinker": {"ignore_eos": True}, "talker": {"temperature": 0.0, "max_tokens": 200}},
    }
    ingress = graph.handle("ingress")
    wait_until(lambda: hostile.idle(graph), 120, "idle stages before the test")
    census = hostile.Census(graph.address)
    before = hostile.stage_stats(graph)
    client = hostile.RawClient(graph.base_url, body)
    try:
        wait_until(lambda: hostile.stage_stats(graph)["talker"]["in_flight"] == 1, 120, "the reply's talker call")
        victim.unharmed()  # while the reply runs for a client that reads nothing
        peak = 0

        def ended() -> bool:
            nonlocal peak
            peak = max(peak, ingress.buffered.remote().result()["peak"])
            return hostile.idle(graph)

        wait_until(ended, 300, "the reply to run to its end")
        # The walk's budget plus one output a queue (a 25-frame audio chunk: 192 KB; 7 queues in this graph).
        assert peak <= (4 << 20) + 7 * (25 * 1920 * 4 + 512), peak
        after = hostile.stage_stats(graph)
        assert after["talker"]["calls"] == before["talker"]["calls"] + 2  # its call and the victim's
        assert after["talker"]["aborted"] == before["talker"]["aborted"]  # both finished, not cut short
        assert census.left()["rss_growth"] < RSS_MARGIN
    finally:
        client.close()
    left = settled(graph, census)
    assert left["rss_growth"] < RSS_MARGIN, left
