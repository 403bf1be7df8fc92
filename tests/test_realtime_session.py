"""A realtime session's response lifecycle against a scripted graph (no Ray): every response ends with
``response.done``, whenever its cancel comes, and the session takes the next one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from omni_serve.api.realtime.admission import Sessions
from omni_serve.api.realtime.session import Session
from omni_serve.api.realtime.session_graph import SessionGraph
from omni_serve.api.realtime.vad import VadWorkers
from omni_serve.graph.config import RealtimeConfig
from omni_serve.graph.stage_log import StageLog
from omni_serve.types import StageOutput, Usage
from tests.test_orchestrator import GRAPH

CREATE = json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}})


def graph(
    outputs: Callable[[Any, str], AsyncIterator[StageOutput]],
    limits: RealtimeConfig | None = None,
    *,
    takes_audio: bool = False,
    speaks: bool = False,
    sampling: Callable[[Any], dict[str, Any]] = lambda request: {},
) -> SessionGraph:
    """A session's view of a graph whose outputs are scripted (``outputs`` plays the orchestrator)."""

    async def voice(name: str, param: str) -> str | None:
        return None

    limits = limits or RealtimeConfig()
    return SessionGraph(
        model="m",
        outputs=outputs,
        sampling=sampling,
        voice=voice,
        stage_log=lambda: StageLog(GRAPH),
        text_stage="thinker",
        speaks=speaks,
        takes_audio=takes_audio,  # False: no VAD, the session starts with turn detection off
        max_audio_parts=4,
        max_audio_bytes=1 << 20,
        limits=limits,
        sessions=Sessions(limits.max_sessions),
        vad=VadWorkers(limits.audio_workers, keep_models=2),
    )


async def replying(request: Any, route: str) -> AsyncIterator[StageOutput]:
    yield StageOutput(stage="thinker", text="hello", finished=True, usage=Usage(prompt_tokens=3, completion_tokens=1))


def recorder() -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """The events a session sends, and the send that records them."""
    events: list[dict[str, Any]] = []
    return events, events.append


def statuses(events: list[dict[str, Any]]) -> list[str]:
    return [e["response"]["status"] for e in events if e["type"] == "response.done"]


async def settle(session: Session) -> None:
    if session.responses.active is not None and session.responses.active.task is not None:
        await asyncio.gather(session.responses.active.task, return_exceptions=True)


def test_a_response_cancelled_before_its_relay_ran_still_ends_and_frees_the_session() -> None:
    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying), send)
        await session.handle(CREATE)  # the relay task exists but has not run yet
        await session.responses.cancel("turn_detected")  # as a barge-in in the same audio append does
        await session.handle(CREATE)
        await settle(session)
        return events

    events = asyncio.run(run())
    assert not [e for e in events if e["type"] == "error"], events
    assert statuses(events) == ["cancelled", "completed"]


def test_a_cancel_while_the_response_finishes_does_not_cut_off_response_done() -> None:
    async def run() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        cancels: list[asyncio.Task[None]] = []

        def send(event: dict[str, Any]) -> None:
            events.append(event)
            if event["type"] == "response.output_text.done":  # the response is sending its closing events
                cancels.append(asyncio.ensure_future(session.responses.cancel("client_cancelled")))

        session = Session(graph(replying), send)
        await session.handle(CREATE)
        await settle(session)
        await asyncio.gather(*cancels)
        return events

    events = asyncio.run(run())
    assert statuses(events) == ["completed"]
    assert events[-1]["type"] == "response.done"


def test_a_failing_graph_ends_the_response_as_failed_and_the_session_goes_on() -> None:
    calls = 0

    async def failing_once(request: Any, route: str) -> AsyncIterator[StageOutput]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a stage died")
        async for output in replying(request, route):
            yield output

    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(failing_once), send)
        for _ in range(2):
            await session.handle(CREATE)
            await settle(session)
        return events

    events = asyncio.run(run())
    assert statuses(events) == ["failed", "completed"]
    failed = next(e for e in events if e["type"] == "response.done")
    assert failed["response"]["status_details"]["error"]["type"] == "server_error"


def test_bounds_the_chat_route_has_hold_in_session_update() -> None:
    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying), send)
        for config in (
            {"max_output_tokens": -5},
            {"audio": {"input": {"transcription": {"prompt": "x" * 5000}}}},
            {"audio": {"input": {"transcription": {"language": "not a language"}}}},
        ):
            await session.handle(json.dumps({"type": "session.update", "session": {"type": "realtime", **config}}))
        await session.handle(CREATE)  # the session still answers, with its defaults
        await settle(session)
        return events

    events = asyncio.run(run())
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [e["type"] for e in errors] == ["invalid_request_error"] * 3, errors
    assert [e["param"] for e in errors] == [
        "session.max_output_tokens",
        "session.audio.input.transcription.prompt",
        "session.audio.input.transcription.language",
    ], errors
    assert statuses(events) == ["completed"]


def test_a_graph_without_audio_input_refuses_input_audio_and_says_it_detects_no_turns() -> None:
    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying), send)
        session.send("session.created", session=session.session_json())
        await session.handle(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAAAA=="}))
        await session.handle(json.dumps({"type": "input_audio_buffer.commit"}))
        await session.handle(CREATE)  # the conversation still answers
        await settle(session)
        return events

    events = asyncio.run(run())
    assert events[0]["session"]["audio"]["input"]["turn_detection"] is None
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert errors[0]["param"] == "audio" and "takes no audio" in errors[0]["message"], errors
    assert not [e for e in events if e["type"] == "input_audio_buffer.committed"]
    assert statuses(events) == ["completed"]
