"""A realtime session's limits against a hostile client, in process (no Ray): what a session may hold, queue
and leave unread, how many sessions a replica holds, and the VAD kept off the event loop.

The sessions run on the real session code over a scripted graph (tests/test_realtime_session.py's), the
websocket is a fake one where the test needs to play a client that never reads. Each breach is an
``error`` event naming its limit; the session, and every other, goes on. The same abuses against the
deployed graph, with a victim session beside them: tests/test_realtime_hostile.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.datastructures import Address
from starlette.websockets import WebSocketState

from omni_serve.api.openai.chat import ChatCompletionRequest
from omni_serve.api.openai.sampling import SamplingRequest
from omni_serve.api.realtime import vad
from omni_serve.api.realtime.connection import serve_session
from omni_serve.api.realtime.session import Session
from omni_serve.api.realtime.settings import Settings
from omni_serve.api.sampling import StageSampling
from omni_serve.graph.config import RealtimeConfig, load_graph
from omni_serve.types import StageOutput
from tests.realtime_session import CREATE, replying, settle
from tests.realtime_session import graph as graph
from tests.realtime_session import recorder as recorder
from tests.tiny_config import tiny_args

RATE = 24000
MIB = 1 << 20


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def append(seconds: float) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": b64(bytes(int(RATE * seconds) * 2))})


def errors(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["error"] for e in events if e["type"] == "error"]


# ---- CPU: the VAD runs off the event loop; appended audio is bounded per second of wall time ---------


def test_one_sessions_vad_work_does_not_hold_up_another_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """While one session's audio is being scored, another session on the same event loop is answered.

    The scoring blocks until the other session's answer is out: on the event loop this would be a
    deadlock (the hang guard then fails the test); on a worker thread it is not.
    """
    answered = threading.Event()
    scored_on: list[int] = []
    real_feed = vad.SpeechDetector.feed

    def slow_feed(self: vad.SpeechDetector, pcm16: bytes) -> list[vad.SpeechEdge]:
        scored_on.append(threading.get_ident())
        scoring.set()
        answered.wait(30)  # the hang guard: False when nobody answered meanwhile
        return real_feed(self, pcm16)

    monkeypatch.setattr(vad.SpeechDetector, "feed", slow_feed)
    scoring = threading.Event()

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        shared = graph(replying, takes_audio=True)
        a_events, a_send = recorder()
        b_events, b_send = recorder()
        a, b = Session(shared, a_send), Session(shared, b_send)
        busy = asyncio.create_task(a.handle(append(0.5)))
        await asyncio.to_thread(scoring.wait, 60)  # a's audio is being scored now
        await b.handle(json.dumps({"type": "input_audio_buffer.clear"}))
        if b_events:
            answered.set()
        await busy
        return a_events, b_events, threading.get_ident()

    a_events, b_events, loop_thread = asyncio.run(run())
    assert [e["type"] for e in b_events] == ["input_audio_buffer.cleared"]
    assert scored_on and scored_on[0] != loop_thread
    assert not errors(a_events), a_events


def test_appended_audio_is_bounded_per_second_of_wall_time() -> None:
    """A burst of ``audio_burst_s``, then ``audio_realtime_factor`` seconds per second: the excess is refused,
    each append with an error event, and never reaches the VAD (its work is what the budget bounds)."""
    limits = RealtimeConfig(audio_burst_s=1.0, audio_realtime_factor=0.001)  # ~no refill during the test

    async def run() -> tuple[list[dict[str, Any]], float]:
        shared = graph(replying, limits, takes_audio=True)
        events, send = recorder()
        session = Session(shared, send)
        for _ in range(3):
            await session.handle(append(0.4))
        await session.handle(append(1.5))  # over the burst: never fits
        return events, shared.vad.audio_s

    events, scored = asyncio.run(run())
    refused = errors(events)
    assert [e["code"] for e in refused] == ["audio_rate_exceeded"] * 2, refused
    assert refused[0]["param"] == "audio" and "realtime.audio_realtime_factor" in refused[0]["message"]
    assert scored == pytest.approx(0.8)  # the two appends that fitted, and nothing else


# ---- memory: the bytes a session holds, and the work it queues -------------------------------------


def test_the_input_audio_buffer_holds_at_most_max_buffered_audio_s() -> None:
    limits = RealtimeConfig(max_buffered_audio_s=1.0)

    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying, limits, takes_audio=True), send)
        manual = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}  # the VAD would trim silence
        await session.handle(json.dumps({"type": "session.update", "session": manual}))
        await session.handle(append(0.6))
        await session.handle(append(0.6))
        await session.handle(json.dumps({"type": "input_audio_buffer.commit"}))
        return events

    events = asyncio.run(run())
    assert [e["code"] for e in errors(events)] == ["input_audio_buffer_full"], errors(events)
    assert [e["type"] for e in events][-3:] == ["input_audio_buffer.committed", "conversation.item.added",
                                                "conversation.item.done"]  # fmt: skip


def item(text: str | None = None, audio: bytes | None = None) -> str:
    if text is not None:
        content = {"type": "input_text", "text": text}
    else:
        content = {"type": "input_audio", "audio": b64(audio or b"")}
    message = {"type": "message", "role": "user", "content": [content]}
    return json.dumps({"type": "conversation.item.create", "item": message})


def test_a_session_holds_at_most_max_session_bytes() -> None:
    """Items beyond the bound: the audio the thinker no longer reads goes first (user audio older than the
    newest ``max_audio_parts`` turns); what still does not fit is refused. The held bytes never pass it."""
    limits = RealtimeConfig(max_session_bytes=MIB, max_event_bytes=MIB, bytes_per_second=1e12)

    async def run() -> tuple[list[dict[str, Any]], list[int], Session]:
        events, send = recorder()
        session = Session(graph(replying, limits, takes_audio=True), send)
        held = []
        for _ in range(8):  # 8 x 150 kB of audio: the graph's requests carry the newest 4 (max_audio_parts)
            await session.handle(item(audio=bytes(150_000)))
            held.append(session.held_bytes())
        for _ in range(2):  # text is never dropped: the second does not fit
            await session.handle(item(text="x" * 300_000))
            held.append(session.held_bytes())
        return events, held, session

    events, held, session = asyncio.run(run())
    assert max(held) <= MIB, held
    assert [e["code"] for e in errors(events)] == ["session_memory_full"], errors(events)
    audio = [i for i in session.conversation.items if i.parts[0].type == "input_audio"]
    assert len(audio) == 8 and [bool(i.parts[0].audio) for i in audio] == [False] * 4 + [True] * 4
    assert all(i.parts[0].audio_ms == 150_000 * 1000 // (RATE * 2) for i in audio)  # a dropped part keeps its length


def test_transcriptions_queue_at_most_max_pending_transcriptions() -> None:
    """A client that commits turns faster than the thinker transcribes: beyond the bound a turn is not
    transcribed (an error event and ``...transcription.failed``), so the session's queued work is bounded."""
    limits = RealtimeConfig(max_pending_transcriptions=2)
    release = asyncio.Event()

    async def transcribing_slowly(request: Any, route: str) -> AsyncIterator[StageOutput]:
        await release.wait()
        yield StageOutput(stage="thinker", text="words", finished=True)

    async def run() -> tuple[list[dict[str, Any]], list[int]]:
        events, send = recorder()
        session = Session(graph(transcribing_slowly, limits, takes_audio=True), send)
        manual = {"audio": {"input": {"turn_detection": None, "transcription": {"model": "m"}}}}
        await session.handle(json.dumps({"type": "session.update", "session": {"type": "realtime", **manual}}))
        pending = []
        for i in range(6):
            await session.handle(append(0.2))
            await session.handle(json.dumps({"type": "input_audio_buffer.commit", "event_id": f"c{i}"}))
            pending.append(len(session.transcriptions.tasks))
        release.set()
        await asyncio.gather(*session.transcriptions.tasks)
        return events, pending

    events, pending = asyncio.run(run())
    assert pending == [1, 2, 2, 2, 2, 2], pending
    refused = errors(events)
    assert [e["code"] for e in refused] == ["too_many_pending_transcriptions"] * 4
    assert [e["event_id"] for e in refused] == ["c2", "c3", "c4", "c5"]
    kinds = [e["type"] for e in events]
    assert kinds.count("conversation.item.input_audio_transcription.failed") == 4
    assert kinds.count("conversation.item.input_audio_transcription.completed") == 2


# ---- absurd token counts: the chat route's bounds, through its validation -------------------------


def test_response_create_is_validated_as_a_chat_completion() -> None:
    """``response.create``'s sampling goes through the chat route's validation: an absurd talker
    ``max_tokens`` (the transformers talker preallocates a row per step) is an error naming the field."""
    sampling = StageSampling(load_graph(tiny_args())).for_request

    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying, sampling=sampling), send)
        for params in (
            {"stage_sampling": {"talker": {"max_tokens": 10**12}}},
            {"stage_sampling": {"talker": {"temperature": -1}}},
            {"stage_sampling": {"vocoder": {}}},
            {"seed": -3},
        ):
            await session.handle(json.dumps({"type": "response.create", "response": params}))
        await session.handle(CREATE)  # the session still answers
        await settle(session)
        return events

    events = asyncio.run(run())
    assert [e["param"] for e in errors(events)] == [
        "response.stage_sampling.talker.max_tokens",
        "response.stage_sampling.talker.temperature",
        "response.stage_sampling",
        "response.seed",
    ], errors(events)
    assert [e["response"]["status"] for e in events if e["type"] == "response.done"] == ["completed"]
    # The one path: a chat completion's request is the same sampling model, with the chat route's fields added.
    assert issubclass(ChatCompletionRequest, SamplingRequest)


# ---- the websocket: a client that never reads; more sessions than a replica holds --------------------


class FakeSocket:
    """What serve_session uses of Starlette's WebSocket; ``reads=False`` plays a client that never reads
    (its socket takes ``window`` bytes, then every send waits, as a full TCP window makes it)."""

    def __init__(self, *, reads: bool = True, window: int = 1 << 16, client: str = "192.0.2.1"):
        self.client = Address(client, 50000)  # the peer's address, as Starlette gives it
        self.headers: dict[str, str] = {}
        self.query_params: dict[str, str] = {}
        self.application_state = WebSocketState.CONNECTING
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []
        self.closed: tuple[int, str] | None = None
        self.reads, self.window, self.taken = reads, window, 0
        self.answered = asyncio.Event()  # the first server event went out

    async def accept(self, subprotocol: str | None = None) -> None:
        self.application_state = WebSocketState.CONNECTED

    async def receive(self) -> dict[str, Any]:
        return await self.incoming.get()

    async def send_text(self, text: str) -> None:
        if not self.reads and self.taken + len(text) > self.window:
            await asyncio.Event().wait()  # the client's window is full: forever
        self.taken += len(text)
        self.sent.append(json.loads(text))
        self.answered.set()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed = (code, reason or "")
        self.application_state = WebSocketState.DISCONNECTED

    def client_sends(self, event: str) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": event})

    def client_leaves(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})


def test_a_client_that_never_reads_is_closed_once_its_unsent_events_pass_the_bound() -> None:
    """The response does not wait on the client (its outputs are read at the graph's pace); what the client
    leaves unread is bounded by ``max_unsent_bytes``, then the session ends: its response cancelled,
    close 1008 (the last error is queued, and dropped with the session when the client still does not read)."""
    limits = RealtimeConfig(max_unsent_bytes=MIB)
    produced = 0
    cancelled = asyncio.Event()

    async def endless_audio(request: Any, route: str) -> AsyncIterator[StageOutput]:
        nonlocal produced
        try:
            while True:
                produced += 1
                yield StageOutput(stage="thinker", text="la " * 1000)  # ~3 kB of text per output
                await asyncio.sleep(0)
        except (asyncio.CancelledError, GeneratorExit):
            cancelled.set()
            raise

    async def run() -> FakeSocket:
        socket = FakeSocket(reads=False)
        socket.client_sends(CREATE)
        session = serve_session(socket, graph(endless_audio, limits), None, None)  # type: ignore[arg-type]
        await asyncio.wait_for(session, 60)
        return socket

    socket = asyncio.run(run())
    assert socket.closed is not None and socket.closed[0] == 1008, socket.closed
    assert cancelled.is_set()
    assert produced * 3000 < 2 * MIB  # the graph stopped within the bound (plus one output)


def test_a_replica_holds_at_most_max_sessions() -> None:
    limits = RealtimeConfig(max_sessions=2)

    async def run() -> tuple[list[FakeSocket], FakeSocket, FakeSocket]:
        shared = graph(replying, limits)
        held = [FakeSocket() for _ in range(2)]
        running = [asyncio.create_task(serve_session(s, shared, None, None)) for s in held]  # type: ignore[arg-type]
        for socket in held:
            await socket.answered.wait()  # its session.created: the session is open
        refused = FakeSocket()
        await serve_session(refused, shared, None, None)  # type: ignore[arg-type]
        held[0].client_leaves()
        await running[0]
        admitted = FakeSocket()  # room again
        admitted.client_leaves()
        await serve_session(admitted, shared, None, None)  # type: ignore[arg-type]
        held[1].client_leaves()
        await running[1]
        return held, refused, admitted

    held, refused, admitted = asyncio.run(run())
    assert refused.closed is not None and refused.closed[0] == 1013
    assert [e["type"] for e in refused.sent] == ["error"] and refused.sent[0]["error"]["code"] == "too_many_sessions"
    assert [e["type"] for e in admitted.sent] == ["session.created"]
    assert all(s.sent[0]["type"] == "session.created" for s in held)


# ---- the session's settings: bounded, counted, and echoed within the byte budget -------------------------


def tools(nbytes: int) -> list[dict[str, Any]]:
    """Function tools whose descriptions add up to about ``nbytes``."""
    return [{"type": "function", "name": f"f{i}", "description": "d" * (nbytes // 100)} for i in range(100)]


def session_update(**fields: Any) -> str:
    return json.dumps({"type": "session.update", "session": {"type": "realtime", **fields}})


EMPTY_UPDATE = json.dumps({"type": "session.update", "session": {}})  # 41 bytes


def test_the_stored_settings_are_bounded_and_counted_in_the_held_bytes() -> None:
    """``max_session_config_bytes`` bounds the settings as ``session.updated`` carries them (a refused update
    leaves the session as it was); what they hold counts in the session's held bytes."""
    limits = RealtimeConfig(bytes_per_second=1e12)

    async def run() -> tuple[list[dict[str, Any]], list[int]]:
        events, send = recorder()
        session = Session(graph(replying, limits), send)
        held = [session.held_bytes()]
        await session.handle(session_update(tools=tools(200_000)))
        held.append(session.held_bytes())
        await session.handle(session_update(tools=tools(2_000_000)))  # the review's 2 MB of tools
        await session.handle(session_update(instructions="i" * (256 << 10)))
        held.append(session.held_bytes())
        return events, held

    events, held = asyncio.run(run())
    updated = [e for e in events if e["type"] == "session.updated"]
    assert len(updated) == 1 and len(json.dumps(updated[0]["session"])) > 200_000
    assert [(e["code"], e["param"]) for e in errors(events)] == [("session_config_too_large", "session")] * 2
    assert "realtime.max_session_config_bytes" in errors(events)[0]["message"]
    assert held[1] - held[0] >= 200_000 and held[2] == held[1], held


def test_session_updated_echoes_are_paid_from_the_bytes_budget_and_serialized_once_per_change() -> None:
    """A 41-byte empty update is answered with the whole session: each echo's bytes are spent from
    ``bytes_per_second`` (past it the update is refused, unapplied), so what a client makes the server send is
    bounded as what it sends is; the session is serialized once per change, not once per echo."""
    limits = RealtimeConfig(bytes_per_second=1.0, max_session_bytes=2 * MIB, max_event_bytes=MIB)  # ~no refill
    serialized = 0
    real_json = Settings.json

    def counting_json(self: Settings, session_id: str, model: str) -> dict[str, Any]:
        nonlocal serialized
        serialized += 1
        return real_json(self, session_id, model)

    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying, limits), send)
        await session.handle(session_update(tools=tools(200_000)))
        for _ in range(20):
            await session.handle(EMPTY_UPDATE)
        return events

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Settings, "json", counting_json)
        events = asyncio.run(run())
    echoed = sum(len(json.dumps(e)) for e in events if e["type"] == "session.updated")
    assert echoed <= 2 * MIB, echoed  # the bucket's burst: max_session_bytes
    refused = errors(events)
    assert refused and {e["code"] for e in refused} == {"rate_limit_exceeded"}, refused
    assert len(refused) + len([e for e in events if e["type"] == "session.updated"]) == 21
    assert serialized == 2, serialized  # the session's first settings, and the update's


# ---- a long reply: its audio kept in time linear in its length ------------------------------------------------


def test_a_long_replys_audio_is_kept_chunk_by_chunk_without_recounting_or_copying_it_whole() -> None:
    """Each audio chunk of a reply is added to the item once: the session's held bytes are not recounted over
    every item per chunk, and the reply's audio so far is not copied per chunk (that made a reply of N chunks
    cost N^2 / 2 chunk copies: 10 minutes of audio in 0.1 s chunks, ~86 GB of copying)."""
    import numpy as np

    import omni_serve.api.realtime.conversation as conversation

    chunks, samples = 6000, 2400  # 10 minutes at 24 kHz in 0.1 s chunks: 28.8 MB of pcm16
    chunk = np.full(samples, 0.25, dtype=np.float32)
    counted = 0
    real_nbytes = conversation.Conversation.nbytes

    def counting_nbytes(self: conversation.Conversation) -> int:
        nonlocal counted
        counted += 1
        return real_nbytes(self)

    async def speaking(request: Any, route: str) -> AsyncIterator[StageOutput]:
        yield StageOutput(stage="thinker", text="la", finished=True)
        for _ in range(chunks):
            yield StageOutput(stage="code2wav", audio=chunk, sample_rate=RATE)

    async def run() -> tuple[list[str], float, Session]:
        kinds: list[str] = []
        session = Session(graph(speaking, speaks=True), lambda e: kinds.append(e if isinstance(e, str) else e["type"]))
        await session.handle(json.dumps({"type": "response.create", "response": {"output_modalities": ["audio"]}}))
        started = time.perf_counter()
        await settle(session)
        return kinds, time.perf_counter() - started, session

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversation.Conversation, "nbytes", counting_nbytes)
        kinds, elapsed, session = asyncio.run(run())
    assert kinds.count("response.output_audio.delta") == chunks and kinds[-1] == "response.done"
    (reply,) = session.conversation.items
    assert len(reply.parts[0].audio) == chunks * samples * 2
    assert counted < 10, counted  # once per max_session_bytes of room spent, not once per chunk
    # Linear: 0.8 s on this 2-core machine (each chunk encoded, base64-encoded, sent); copying the reply whole per
    # chunk took 228 s.
    assert elapsed < 20, elapsed


# ---- room: idle sessions end, and no one client takes a replica's sessions -------------------------------


def test_a_session_whose_client_sends_nothing_for_idle_timeout_s_is_closed() -> None:
    """Each client event restarts the idle clock, and so does a running response (the client is listening);
    ``idle_timeout_s`` after the last of them the session ends: an ``error`` event, close 1008."""
    limits = RealtimeConfig(idle_timeout_s=0.5)

    async def slow_reply(request: Any, route: str) -> AsyncIterator[StageOutput]:
        await asyncio.sleep(1.0)  # longer than the idle timeout: the client waits for it, it is not idle
        async for output in replying(request, route):
            yield output

    async def run() -> tuple[FakeSocket, float]:
        socket = FakeSocket()
        session = asyncio.ensure_future(serve_session(socket, graph(slow_reply, limits), None, None))  # type: ignore[arg-type]
        await socket.answered.wait()
        for _ in range(3):  # 0.9 s of events, 0.3 s apart: never idle
            await asyncio.sleep(0.3)
            socket.client_sends(EMPTY_UPDATE)
        socket.client_sends(CREATE)
        started = time.monotonic()
        await asyncio.wait_for(session, 30)
        return socket, time.monotonic() - started

    socket, lasted = asyncio.run(run())
    kinds = [e["type"] for e in socket.sent]
    assert kinds.count("session.updated") == 3 and statuses_of(socket.sent) == ["completed"], kinds
    assert kinds[-1] == "error" and socket.sent[-1]["error"]["code"] == "session_idle_timeout", socket.sent[-1]
    assert "realtime.idle_timeout_s" in socket.sent[-1]["error"]["message"]
    assert socket.closed is not None and socket.closed[0] == 1008, socket.closed
    assert 1.5 <= lasted < 10, lasted  # the reply's 1 s, then the idle 0.5 s


def statuses_of(events: list[dict[str, Any]]) -> list[str]:
    return [e["response"]["status"] for e in events if e["type"] == "response.done"]


async def holding(shared: Any, client: str, n: int) -> tuple[list[FakeSocket], list[asyncio.Task]]:
    """``n`` sessions of ``client`` admitted and held open (their client never leaves until told)."""
    held = [FakeSocket(client=client) for _ in range(n)]
    running = [asyncio.create_task(serve_session(s, shared, None, None)) for s in held]  # type: ignore[arg-type]
    for socket in held:
        await socket.answered.wait()
    return held, running


def test_a_client_holds_at_most_max_sessions_per_client() -> None:
    """A client (its address, when the graph sets no key) holds ``max_sessions_per_client`` sessions; one more is
    refused with an ``error`` event and close 1008; another client is admitted, and the first is again once one
    of its sessions ended."""
    limits = RealtimeConfig(max_sessions_per_client=2)

    async def run() -> tuple[FakeSocket, FakeSocket, FakeSocket]:
        shared = graph(replying, limits)
        held, running = await holding(shared, "192.0.2.1", 2)
        refused = FakeSocket(client="192.0.2.1")
        refused_session = serve_session(refused, shared, None, None)  # type: ignore[arg-type]
        with contextlib.suppress(asyncio.TimeoutError):  # the hang guard: an admitted session waits for its client
            await asyncio.wait_for(refused_session, 10)
        other = FakeSocket(client="192.0.2.2")
        other.client_leaves()
        await serve_session(other, shared, None, None)  # type: ignore[arg-type]
        held[0].client_leaves()
        await running[0]
        again = FakeSocket(client="192.0.2.1")
        again.client_leaves()
        await serve_session(again, shared, None, None)  # type: ignore[arg-type]
        held[1].client_leaves()
        await running[1]
        return refused, other, again

    refused, other, again = asyncio.run(run())
    assert refused.closed is not None and refused.closed[0] == 1008, refused.closed
    assert [e["type"] for e in refused.sent] == ["error"], refused.sent
    error = refused.sent[0]["error"]
    assert error["code"] == "too_many_client_sessions" and "realtime.max_sessions_per_client" in error["message"]
    assert [e["type"] for e in other.sent] == ["session.created"]
    assert [e["type"] for e in again.sent] == ["session.created"]


@pytest.mark.parametrize("per_client", ["default", None])
def test_by_default_one_client_holds_16_of_a_replicas_sessions_and_null_lifts_the_quota(per_client: Any) -> None:
    """The default quota (16, half of ``max_sessions``) refuses a 17th session from one address while the
    replica has room, another address is admitted meanwhile, and the replica counts each client's sessions;
    ``max_sessions_per_client: null`` leaves ``max_sessions`` alone to bound a client."""
    limits = RealtimeConfig() if per_client == "default" else RealtimeConfig(max_sessions_per_client=None)
    assert limits.max_sessions_per_client == (16 if per_client == "default" else None) and limits.max_sessions == 32

    async def run() -> tuple[FakeSocket, FakeSocket, dict[str, Any]]:
        shared = graph(replying, limits)
        held, running = await holding(shared, "192.0.2.1", 16)
        seventeenth = FakeSocket(client="192.0.2.1")
        opened = asyncio.create_task(serve_session(seventeenth, shared, None, None))  # type: ignore[arg-type]
        await asyncio.wait_for(seventeenth.answered.wait(), 10)
        other = FakeSocket(client="192.0.2.2")
        other_session = asyncio.create_task(serve_session(other, shared, None, None))  # type: ignore[arg-type]
        await asyncio.wait_for(other.answered.wait(), 10)
        stats = shared.sessions.stats()
        for socket in [*held, seventeenth, other]:
            socket.client_leaves()
        await asyncio.wait_for(asyncio.gather(*running, opened, other_session), 30)
        return seventeenth, other, stats

    seventeenth, other, stats = asyncio.run(run())
    assert [e["type"] for e in other.sent[:1]] == ["session.created"]
    if per_client == "default":
        assert [e["type"] for e in seventeenth.sent] == ["error"], seventeenth.sent
        assert seventeenth.sent[0]["error"]["code"] == "too_many_client_sessions"
        assert seventeenth.closed is not None and seventeenth.closed[0] == 1008, seventeenth.closed
        assert stats["clients"] == {"192.0.2.1": 16, "192.0.2.2": 1}, stats
    else:
        assert [e["type"] for e in seventeenth.sent[:1]] == ["session.created"], seventeenth.sent
        assert stats["clients"] == {"192.0.2.1": 17, "192.0.2.2": 1}, stats
