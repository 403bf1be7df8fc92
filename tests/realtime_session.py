"""A realtime session over a fake graph: its graph, the events it sends, and waiting until it settles."""

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
from tests.fake_stages import GRAPH

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


def recorder() -> tuple[list[dict[str, Any]], Callable[[dict[str, Any] | str], None]]:
    """The events a session sends, and the send that records them."""
    events: list[dict[str, Any]] = []
    return events, lambda event: events.append(decoded(event))


async def settle(session: Session) -> None:
    if session.responses.active is not None and session.responses.active.task is not None:
        await asyncio.gather(session.responses.active.task, return_exceptions=True)


def decoded(event: dict[str, Any] | str) -> dict[str, Any]:
    """A server event as the client reads it (the session sends some as their JSON text)."""
    return json.loads(event) if isinstance(event, str) else event
