"""The Realtime API under a hostile client, against the deployed tiny graph: large appends, event floods,
item floods, many sessions, absurd token counts, malformed JSON.

Each abuse gets a clean ``error`` event naming its limit (the session goes on, or, past the replica's
sessions, is refused with one), what the ingress holds and the VAD work it does stay within the graph's
``realtime`` bounds (read from the ingress replica itself), and a victim session on the same ingress
replica, seeded, gets the reply it gets alone, byte for byte. A client that never reads is in
tests/test_realtime_never_reads.py (only the HAProxy ingress lets the replica see it); the limits one by
one, in process: tests/test_realtime_limits.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest

from omni_serve.graph.config import RealtimeConfig
from tests.conftest import one_replica_per_stage, wait_until
from tests.in_flight import idle
from tests.realtime_client import Raw, of, realtime_stats, realtime_url

pytestmark = pytest.mark.integration

T = TypeVar("T")
RATE = 24000
LIMITS = RealtimeConfig()  # the deployed graph sets none: the defaults are what is tested
SEEDED = {"seed": 11, "instructions": "Answer briefly."}


@pytest.fixture(scope="module")
def graph(tiny_omni: Any) -> Any:
    return one_replica_per_stage(tiny_omni)  # one ingress replica: the victim shares it with the abuser


def silence_b64(seconds: float) -> str:
    return base64.b64encode(bytes(int(RATE * seconds) * 2)).decode()


def ingress_rss() -> int:
    """The ingress replica's resident memory (the test runs on the cluster's one node)."""

    import psutil

    from tests.faults import replica_pid

    pid = replica_pid("ingress")
    return int(psutil.Process(pid).memory_info().rss)


async def session(graph: Any) -> Any:
    import websockets

    ws = await websockets.connect(realtime_url(graph), max_size=None)
    s = Raw(ws)
    await s.until("session.created")
    return s


@contextlib.asynccontextmanager
async def opened(graph: Any) -> AsyncIterator[Any]:
    s = await session(graph)
    try:
        yield s
    finally:
        await s.ws.close()


async def victim_reply(graph: Any, already: Any = None) -> tuple[str, bytes]:
    s = already or await session(graph)
    try:
        events = await s.reply("Tell me about the sea.", **SEEDED)
    finally:
        await s.ws.close()
    assert events[-1]["response"]["status"] in ("completed", "incomplete"), events[-1]
    text = "".join(e["delta"] for e in of(events, "response.output_audio_transcript.delta"))
    audio = b"".join(base64.b64decode(e["delta"]) for e in of(events, "response.output_audio.delta"))
    return text, audio


@pytest.fixture(scope="module")
def solo(graph: Any) -> tuple[str, bytes]:
    """The victim's reply with nothing else running."""
    wait_until(lambda: idle(graph), 90, "idle stages before the victim's solo reply")
    reply = asyncio.run(victim_reply(graph))
    assert reply[0] and reply[1]
    return reply


def beside_victim(graph: Any, solo: tuple[str, bytes], abuse: Callable[[], Awaitable[T]]) -> T:
    """Run ``abuse`` and the victim's reply at once; the victim's reply must be its solo reply."""

    async def both() -> tuple[T, tuple[str, bytes]]:
        return await asyncio.gather(abuse(), victim_reply(graph))

    result, victim = asyncio.run(both())
    assert victim == solo, "the abuse changed another session's reply"
    wait_until(lambda: realtime_stats(graph)["sessions"] == 0, 60, "every session of the test to end")
    return result


def test_large_appends_are_bounded_in_audio_per_second(graph: Any, solo: tuple[str, bytes]) -> None:
    """An append over the burst is refused; a flood of appends is taken at most at the real-time factor
    (a burst, then the factor times the time it took, at whatever speed), and the VAD scores exactly
    what was taken (its CPU is per audio second)."""
    before = realtime_stats(graph)["vad_audio_s"]

    async def abuse() -> tuple[list[dict[str, Any]], float, int]:
        async with opened(graph) as s:
            big = {"type": "input_audio_buffer.append", "event_id": "big", "audio": silence_b64(35)}
            error = await s.error_for(big)
            assert error["code"] == "audio_rate_exceeded" and error["event_id"] == "big", error
            started = time.monotonic()
            for _ in range(24):  # 120 s of audio as fast as the socket takes it
                await s.send({"type": "input_audio_buffer.append", "audio": silence_b64(5)})
            await s.send({"type": "input_audio_buffer.clear"})
            answers = await s.until("input_audio_buffer.cleared")
            elapsed = time.monotonic() - started  # an upper bound of the time the server took them in
            return of(answers, "error"), elapsed, 24

    refused, elapsed, sent = beside_victim(graph, solo, abuse)
    # Refused or not depends on how fast this machine scores (the budget refills meanwhile); the bound does not.
    assert all(e["error"]["code"] == "audio_rate_exceeded" for e in refused), refused
    taken_s = 5.0 * (sent - len(refused))
    assert taken_s <= LIMITS.audio_burst_s + LIMITS.audio_realtime_factor * elapsed + 1e-6, (taken_s, elapsed)
    assert realtime_stats(graph)["vad_audio_s"] - before == pytest.approx(taken_s)


def test_event_floods_are_bounded_per_second(graph: Any, solo: tuple[str, bytes]) -> None:
    """Every event of a flood is answered, by its own reply or a rate-limit error; those taken fit the
    bucket (a burst of twice the rate, then the rate) whatever the speed of the machine."""

    async def abuse() -> tuple[list[dict[str, Any]], float]:
        async with opened(graph) as s:
            started = time.monotonic()
            for _ in range(600):
                await s.send({"type": "input_audio_buffer.clear"})
            answers = [await s.recv() for _ in range(600)]
            return answers, time.monotonic() - started

    answers, elapsed = beside_victim(graph, solo, abuse)
    refused = of(answers, "error")
    assert all(e["error"]["code"] == "rate_limit_exceeded" for e in refused), refused
    taken = len(of(answers, "input_audio_buffer.cleared"))
    assert taken + len(refused) == 600
    rate = LIMITS.events_per_second
    assert taken <= 2 * rate + rate * elapsed, (taken, elapsed)


def test_item_floods_are_bounded_in_bytes(graph: Any, solo: tuple[str, bytes]) -> None:
    """Items of 4 MiB of audio, 40 MiB in all: the session holds at most max_session_bytes, every item is
    added or refused with an error event, and the ingress's memory grows by about that much at most. Which
    items are refused depends on the machine's speed: past max_session_bytes the session drops user audio
    the thinker no longer reads rather than refuse, and the byte budget refills while each answer is awaited
    (a loaded machine refused none; the bound on what is held is the check)."""
    rss_before = ingress_rss()
    audio = silence_b64(4 * 2**20 / (RATE * 2))

    async def abuse() -> tuple[list[dict[str, Any]], list[int], int]:
        answers, held = [], []
        async with opened(graph) as s:
            for i in range(10):
                message = {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}
                await s.send({"type": "conversation.item.create", "event_id": f"i{i}", "item": message})
                reply = await s.recv()
                if reply["type"] == "conversation.item.added":
                    reply = await s.recv()  # its .done
                answers.append(reply)
                held.append(max((await asyncio.to_thread(realtime_stats, graph))["held_bytes"]))
            return answers, held, await asyncio.to_thread(ingress_rss)

    answers, held, rss = beside_victim(graph, solo, abuse)
    refused = [a["error"] for a in answers if a["type"] == "error"]
    assert {e["code"] for e in refused} <= {"session_memory_full", "rate_limit_exceeded"}, refused
    assert len(refused) + len(of(answers, "conversation.item.done")) == 10
    assert max(held) <= LIMITS.max_session_bytes, held
    # What the session holds, the flood's JSON and base64 in flight, and allocator slack: not the 40 MiB sent.
    assert rss - rss_before < 2 * LIMITS.max_session_bytes + (64 << 20), (rss_before, rss)


def test_a_replica_refuses_sessions_beyond_max_sessions_and_one_client_beyond_its_quota(
    graph: Any, solo: tuple[str, bytes]
) -> None:
    """Behind the HAProxy ingress, clients from 127.0.0.2 and 127.0.0.3 are two clients (HAProxy forwards each
    one's address): one takes its ``max_sessions_per_client``, its next is refused with an error event and close
    1008 while the replica has room, the other fills the replica to ``max_sessions`` (the victim's among them),
    and the next, from a third address, is refused with close 1013. The victim, meanwhile, replies as alone."""
    import websockets

    quota, room = LIMITS.max_sessions_per_client, LIMITS.max_sessions
    assert quota is not None and 1 < quota < room - 1  # room for the victim, one full client, and another

    async def session_from(source: str) -> Any:
        ws = await websockets.connect(realtime_url(graph), max_size=None, local_addr=(source, 0))
        s = Raw(ws)
        await s.until("session.created")
        return s

    async def refused_from(source: str) -> tuple[dict[str, Any], int]:
        ws = await websockets.connect(realtime_url(graph), max_size=None, local_addr=(source, 0))
        refused = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None
        return refused, closed.value.rcvd.code

    async def run() -> tuple[tuple[dict[str, Any], int], tuple[dict[str, Any], int], dict[str, Any], Any]:
        victim = asyncio.ensure_future(victim_reply(graph, await session_from("127.0.0.1")))
        held = []
        try:
            held += [await session_from("127.0.0.2") for _ in range(quota)]
            over_quota = await refused_from("127.0.0.2")
            held += [await session_from("127.0.0.3") for _ in range(room - 1 - quota)]
            full = await refused_from("127.0.0.4")
            stats = await asyncio.to_thread(realtime_stats, graph)
            reply = await victim
        finally:
            for s in held:
                await s.ws.close()
        return over_quota, full, stats, reply

    wait_until(lambda: realtime_stats(graph)["sessions"] == 0, 60, "no session open before the test")
    (over_quota, over_quota_code), (full, full_code), stats, reply = asyncio.run(run())
    assert over_quota["type"] == "error" and over_quota["error"]["code"] == "too_many_client_sessions", over_quota
    assert over_quota_code == 1008
    assert full["type"] == "error" and full["error"]["code"] == "too_many_sessions", full
    assert full_code == 1013
    # The replica's own count: each address a client of its own (the victim's may have ended by then).
    assert {k: v for k, v in stats["clients"].items() if k != "127.0.0.1"} == {
        "127.0.0.2": quota,
        "127.0.0.3": room - 1 - quota,
    }, stats
    assert reply == solo


def test_absurd_token_counts_are_refused_by_the_chat_routes_bounds(graph: Any, solo: tuple[str, bytes]) -> None:
    async def abuse() -> list[dict[str, Any]]:
        async with opened(graph) as s:
            return [
                await s.error_for({"type": "response.create", "event_id": event_id, "response": params})
                for event_id, params in (
                    ("t", {"stage_sampling": {"talker": {"max_tokens": 10**12}}}),
                    ("m", {"max_output_tokens": 10**12}),
                    ("l", {"stage_sampling": {"thinker": {"max_tokens": 2**20 + 1}}}),
                )
            ]

    talker, output, thinker = beside_victim(graph, solo, abuse)
    assert talker["param"] == "response.stage_sampling.talker.max_tokens" and talker["event_id"] == "t", talker
    assert output["param"] == "response.max_output_tokens", output
    assert thinker["param"] == "response.stage_sampling.thinker.max_tokens", thinker


def test_malformed_json_gets_an_error_event_and_the_session_goes_on(graph: Any, solo: tuple[str, bytes]) -> None:
    async def abuse() -> list[dict[str, Any]]:
        async with opened(graph) as s:
            errors = [
                await s.error_for(raw)
                for raw in ("{not json", "][", "[" * 100_000, '{"type": "session.update", "session": ' + "[" * 50_000)
            ]
            await s.ws.send(b"\xff\xfe binary, not UTF-8")
            errors.append((await s.until("error"))[-1]["error"])
            events = await s.reply("Still there?", output_modalities=["text"], max_output_tokens=4)
            assert events[-1]["response"]["status"] in ("completed", "incomplete"), events[-1]
            return errors

    errors = beside_victim(graph, solo, abuse)
    assert [e["type"] for e in errors] == ["invalid_request_error"] * 5, errors
    assert all("JSON" in e["message"] for e in errors), errors


def test_odd_event_types_get_an_error_event_and_the_session_goes_on(graph: Any, solo: tuple[str, bytes]) -> None:
    """A ``type`` of any JSON type but a string, a ``session`` that is no object, an event that is no object:
    each an ``error`` event (it once closed the socket with 1011), and the session still answers."""
    odd: list[Any] = [{"type": []}, {"type": 1}, {"type": None}, {"type": {}}]
    odd += [{"type": "session.update", "session": []}, [], 1]

    async def abuse() -> list[dict[str, Any]]:
        async with opened(graph) as s:
            errors = [await s.error_for(json.dumps(event)) for event in odd]
            events = await s.reply("Still there?", output_modalities=["text"], max_output_tokens=4)
            assert events[-1]["response"]["status"] in ("completed", "incomplete"), events[-1]
            return errors

    errors = beside_victim(graph, solo, abuse)
    assert [e["param"] for e in errors] == ["type"] * 4 + ["session", None, None], errors
    assert [e["code"] for e in errors[:4]] == ["unknown_event"] * 4, errors


def test_session_updated_echoes_are_bounded_and_paid_from_the_bytes_budget(graph: Any, solo: tuple[str, bytes]) -> None:
    """The review's 2 MB of tools is refused (``max_session_config_bytes``); with 200 kB of tools stored, a flood
    of 41-byte empty updates is echoed within the session's ``bytes_per_second`` (its burst, and its rate for
    the time the flood took), the rest refused; the victim's reply stays its own."""
    tools = [{"type": "function", "name": f"f{i}", "description": "d" * 2000} for i in range(100)]
    big = [{"type": "function", "name": f"f{i}", "description": "d" * 20_000} for i in range(100)]
    flood = 400

    async def abuse() -> tuple[dict[str, Any], list[dict[str, Any]], float]:
        async with opened(graph) as s:
            too_big = await s.error_for({"type": "session.update", "session": {"tools": big}})
            await s.send({"type": "session.update", "session": {"tools": tools}})
            await s.until("session.updated")
            started = time.perf_counter()
            for _ in range(flood):
                await s.send('{"type":"session.update","session":{}}')
            answers = [await s.recv() for _ in range(flood)]
            return too_big, answers, time.perf_counter() - started

    too_big, answers, elapsed = beside_victim(graph, solo, abuse)
    assert (too_big["code"], too_big["param"]) == ("session_config_too_large", "session"), too_big
    echoes = [a for a in answers if a["type"] == "session.updated"]
    refused = [a["error"] for a in answers if a["type"] == "error"]
    assert echoes and refused and {e["code"] for e in refused} == {"rate_limit_exceeded"}, refused
    echoed = sum(len(json.dumps(e)) for e in echoes)
    assert echoed <= LIMITS.max_session_bytes + LIMITS.bytes_per_second * elapsed, (echoed, elapsed)
