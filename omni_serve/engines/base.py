"""The stage-engine interface every engine family implements.

A stage deployment owns exactly one engine. The deployment resolves the upstream
handoff (an ObjectRef) to a :class:`HandoffPayload` before calling :meth:`stream`, and
puts any payload the engine yields back into the object store, so engines never see
Ray. Engines must be safe under concurrent ``stream`` calls: per-request state lives
in the call, never on ``self``.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

from omni_serve.payload import HandoffPayload
from omni_serve.types import RequestId, StageOutput, StageRequest


class StageEngine(abc.ABC):
    """One engine instance serving one stage inside one replica."""

    # The rate audio input is decoded to for this engine (its feature extractor's; Whisper's 16 kHz
    # unless the engine reads another from its processor). Used only for engines that take audio.
    audio_input_rate: int = 16000

    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        self.stage_name = stage_name
        self.engine_args = engine_args

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights and get ready; called once in the replica before any request."""

    @abc.abstractmethod
    def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        """Run one request; yield outputs in order, the last one with ``finished=True``."""

    async def abort(self, request_id: RequestId) -> None:
        """Stop work for ``request_id`` (client gone). Default: nothing is running detached."""

    async def check_health(self) -> None:
        """Raise if the engine can no longer serve."""

    def shutdown(self) -> None:
        """Release what start() acquired (child processes, device memory); called when the replica stops."""

    def voices(self) -> list[str]:
        """The voice names this stage can speak with ([] = it has no voices).

        The ingress validates a request's voice against these before any stage runs, so an
        engine never sees a voice outside this list (matching is case-insensitive).
        """
        return []

    def stats(self) -> dict[str, Any]:
        """Engine-level numbers for metrics and autoscaling (e.g. waiting/running requests)."""
        return {}
