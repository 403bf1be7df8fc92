"""Voices: what a request may name, and how a name becomes one of the graph's voices.

A graph's voices are the union of what its stages' engines declare (``StageEngine.voices``,
e.g. the Qwen3-Omni talker's speakers). Names are matched case-insensitively. Other names
(OpenAI's ``alloy``, ``echo``, ...) work only through the graph's ``voice_aliases`` table;
anything else is a 400 before any stage runs, listing what the graph speaks.
"""

from __future__ import annotations

from typing import Any

from omni_serve.api.openai.errors import bad_request


def resolve_voice(requested: str | None, voices: list[str], aliases: dict[str, str], param: str) -> str | None:
    """The graph voice for ``requested`` (None: the model's default voice)."""
    if requested is None:
        return None
    name = requested.lower()
    voice = aliases.get(name, name)
    if voice in voices:
        return voice
    known = f"this graph's voices are {voices}" if voices else "this graph has no voices"
    if aliases:
        known += f"; aliases: {sorted(aliases)}"
    raise bad_request(f"{param}: unknown voice {requested!r}; {known}", param)


def voices_json(voices: list[str], aliases: dict[str, str]) -> dict[str, Any]:
    """The voice list as ``GET /v1/audio/voices`` and the ``/v1/models`` card show it (vLLM-Omni's shape + aliases)."""
    return {
        "voices": voices,
        "aliases": {alias: voice for alias, voice in sorted(aliases.items())},
        "uploaded_voices": [],
    }
