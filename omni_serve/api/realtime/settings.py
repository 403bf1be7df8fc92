"""A session's settings (``session.updated`` shows them whole) and the ``session.update`` that changes them.

Settings are a value: an update makes new settings (or returns the same object when it sets nothing), checked
whole against the graph; the session applies them only once its bytes allow them too, so a refused update
leaves the session as it was, and the serialized settings it keeps stay those of the object it holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_serve.api.openai.errors import bad_request
from omni_serve.api.realtime import events as ev
from omni_serve.api.realtime.session_graph import SessionGraph
from omni_serve.api.realtime.tools import ToolChoice, Tools, choice_json, tool_calling


@dataclass(frozen=True)
class Settings:
    instructions: str = ""
    modalities: list[str] = field(default_factory=lambda: ["audio"])
    voice: str | None = None  # as the client named it
    turn: ev.TurnDetection | None = field(default_factory=ev.TurnDetection)
    transcription: ev.Transcription | None = None
    max_output_tokens: int | str = "inf"
    tools: Tools = field(default_factory=list)
    tool_choice: ToolChoice | None = None  # None: auto, OpenAI's default
    parallel_tool_calls: bool | None = None  # None: true

    def json(self, session_id: str, model: str) -> dict[str, Any]:
        """OpenAI's ``realtime.session`` object."""
        fmt = {"type": "audio/pcm", "rate": ev.PCM_RATE}
        turn = None if self.turn is None else {"type": "server_vad", **self.turn.model_dump(exclude={"type"})}
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": model,
            "instructions": self.instructions,
            "output_modalities": self.modalities,
            "max_output_tokens": self.max_output_tokens,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools],
            "tool_choice": choice_json(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "audio": {
                "input": {
                    "format": fmt,
                    "turn_detection": turn,
                    "transcription": self.transcription.model_dump() if self.transcription else None,
                },
                "output": {"format": fmt, "voice": self.voice},
            },
        }


class Session(Protocol):
    """What ``session.update`` uses of its session (:class:`~omni_serve.api.realtime.session.Session`)."""

    graph: SessionGraph
    settings: Settings
    spoke: bool


async def update(session: Session, config: ev.SessionConfig) -> Settings:
    """The session's settings with ``session.update`` applied, checked against the graph (the session's own
    object when the update sets nothing); the session checks their bytes, then holds them."""
    s, graph = session.settings, session.graph
    if config.model is not None and config.model != graph.model:
        raise bad_request(f"session.model: this server serves '{graph.model}'", "session.model")
    modalities = config.output_modalities
    if modalities == ["audio"] and not graph.speaks:
        param = "session.output_modalities"
        raise bad_request(f"{param}: this graph does not produce audio", param)
    audio = config.audio or ev.SessionAudio()
    voice = audio.output.voice if audio.output else None
    if voice is not None:
        if session.spoke and voice != s.voice:
            raise bad_request("session.audio.output.voice: the voice cannot change once audio was sent", "voice")
        await graph.voice(voice, "session.audio.output.voice")
    turn_set = audio.input is not None and "turn_detection" in audio.input.model_fields_set
    turn_on = turn_set and audio.input is not None and audio.input.turn_detection is not None
    if turn_on and not graph.takes_audio:
        raise bad_request("session.audio.input.turn_detection: this graph takes no audio", "turn_detection")
    tools = s.tools if config.tools is None else config.tools
    choice = config.tool_choice if "tool_choice" in config.model_fields_set else s.tool_choice
    parallel = s.parallel_tool_calls if config.parallel_tool_calls is None else config.parallel_tool_calls
    tools_set = config.tools is not None or "tool_choice" in config.model_fields_set
    if tools_set or config.parallel_tool_calls is not None:  # else checked when set: an empty update costs nothing
        tool_calling(tools, choice, parallel, "session.")  # checked as chat checks a request's tools
    # Validated whole: the new settings.
    changes: dict[str, Any] = {}
    if config.instructions is not None:
        changes["instructions"] = config.instructions
    if modalities is not None:
        changes["modalities"] = list(modalities)
    if voice is not None:
        changes["voice"] = voice
    if config.max_output_tokens is not None:
        changes["max_output_tokens"] = config.max_output_tokens
    if config.tools is not None:
        changes["tools"] = config.tools
    if "tool_choice" in config.model_fields_set:
        changes["tool_choice"] = choice
    if config.parallel_tool_calls is not None:
        changes["parallel_tool_calls"] = parallel
    if audio.input is not None and "transcription" in audio.input.model_fields_set:
        changes["transcription"] = audio.input.transcription
    if turn_set and audio.input is not None:
        changes["turn"] = audio.input.turn_detection
    return dataclasses.replace(s, **changes) if changes else s
