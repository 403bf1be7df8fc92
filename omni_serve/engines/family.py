"""What an engine family declares about itself, once: its args, how to create its engine, and its capabilities.

Each family module ends with one ``FAMILY = Family(...)``; :mod:`omni_serve.engines` reads nothing else of it,
and a capability a family leaves out has the default here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from omni_serve.engines.base import StageEngine
from omni_serve.types import Modality


def _text_only(args: Any) -> set[Modality]:
    return {Modality.TEXT}


def _chat(args: Any) -> str:
    return "chat"


def _no_extensions(engine_args: dict[str, Any]) -> frozenset[str]:
    return frozenset()


def _whole_input(engine_args: dict[str, Any]) -> bool:
    return False


@dataclass(frozen=True)
class Family:
    engine_args: type[BaseModel]  # the stage's engine_args, validated (cheap to import: heavy imports are start()'s)
    create: Callable[[str, dict[str, Any]], StageEngine]  # (stage name, engine_args) -> the engine
    # What an entry stage takes in chat messages (its validated args), text always among them.
    input_modalities: Callable[[Any], set[Modality]] = _text_only
    # What an entry stage builds its prompt from (its validated args): ``chat``, or ``speech`` (the text to speak
    # alone: a TTS model).
    entry_prompt: Callable[[Any], str] = _chat
    # Which of vLLM's extra sampling parameters (omni_serve.types.SAMPLING_EXTENSIONS) it honours.
    honoured_sampling: Callable[[dict[str, Any]], frozenset[str]] = _no_extensions
    # Whether its engine can read its upstream's handoff as a stream of chunks (a stage's ``stream_input``).
    reads_streamed_input: Callable[[dict[str, Any]], bool] = _whole_input
