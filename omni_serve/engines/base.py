"""The stage-engine interface every engine family implements.

A stage deployment owns exactly one engine. The deployment resolves the upstream
handoff (an ObjectRef) to a :class:`HandoffPayload` and calls :meth:`StageEngine.generate`,
and puts any payload the engine yields back into the object store, so engines never see
Ray. Engines must be safe under concurrent calls: per-request state lives in the call,
never on ``self``.

What is written once, here, for every family: the exception ladder around each call and the
health check (:mod:`omni_serve.engines.ladder`), and abort by request id over the registry of
live engine requests (:mod:`omni_serve.engines.calls`). A family writes :meth:`stream` and the
hooks it needs (``_abort``, ``probe_health``, ``dead_reason``, ``invalid_input``).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from omni_serve.engines import ladder
from omni_serve.engines.calls import LiveCalls
from omni_serve.exceptions import InvalidStageInput
from omni_serve.payload import HandoffPayload
from omni_serve.types import RequestId, StageOutput, StageRequest, VideoRules


class StageEngine(abc.ABC):
    """One engine instance serving one stage inside one replica."""

    # The rate audio input is decoded to for this engine (its feature extractor's; Whisper's 16 kHz
    # unless the engine reads another from its processor). Used only for engines that take audio.
    audio_input_rate: int = 16000

    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        self.stage_name = stage_name
        self.engine_args = engine_args
        # Set by the stage before start() when the graph streams this stage's input (its ``stream_input``):
        # an engine that must be built for streamed input (vLLM-Omni's async-chunk talker) reads it there.
        self.stream_input = False
        # The engine requests (or job handles) of live calls: what abort() stops. Families that run
        # nothing detached from the caller never register anything.
        self.calls: LiveCalls[Any] = LiveCalls()
        self.dead: str | None = None  # why the engine can no longer serve; None while it can

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights and get ready; called once in the replica before any request."""

    # ---- calls: the template and the family's part ---------------------------------------------

    def generate(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncGenerator[StageOutput, None]:
        """Run one stage call under the exception ladder; what the stage deployment calls.

        Yields :meth:`stream`'s outputs. Leaving early (cancelled, closed) aborts the call's engine
        requests; failures reach the caller as ``EngineDeadError``, ``InvalidStageInput`` or
        ``EngineError`` (:mod:`omni_serve.engines.ladder`).
        """
        return ladder.guarded(self, request, handoff)

    @abc.abstractmethod
    def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        """The family's run of one request: yield outputs in order, the last one with ``finished=True``.

        Register work that runs detached from this generator in ``self.calls`` (``track``) and
        ``finish()`` it when the engine is done with it; aborting and error mapping are the ladder's.
        """

    async def abort(self, request_id: RequestId) -> None:
        """Stop the engine work of every live call made with ``request_id`` (client gone)."""
        handles = self.calls.take(request_id)
        if handles:
            await self._abort(handles)

    async def _abort(self, handles: list[Any]) -> None:
        """Stop these tracked engine requests (the family's handles from ``self.calls``)."""

    def dead_reason(self, err: BaseException) -> str | None:
        """A short reason when ``err`` means the engine can no longer serve any request; None otherwise."""
        return None

    def invalid_input(self, err: BaseException) -> InvalidStageInput | None:
        """The bad-request error ``err`` stands for, when the engine library raised its own kind; None otherwise."""
        return None

    def mark_dead(self, reason: str) -> None:
        """From now on every call and health check raises ``EngineDeadError`` (the first reason is kept)."""
        if self.dead is None:
            self.dead = reason

    # ---- health ------------------------------------------------------------------------------

    async def check_health(self) -> None:
        """Raise if the engine can no longer serve (Serve's health check: the replica is then replaced)."""
        await ladder.checked_health(self)

    async def probe_health(self) -> None:
        """The family's own check (engine started, EngineCore alive); raise when it fails."""

    # ---- the rest ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Release what start() acquired (child processes, device memory); called when the replica stops."""

    def merge_handoffs(self, first: HandoffPayload, later: HandoffPayload) -> HandoffPayload:
        """Two consecutive chunks of a streamed handoff this engine yields, as one (the stage coalesces
        them under load). Engines that stream no handoff never get asked."""
        raise NotImplementedError(f"{type(self).__name__} streams no handoff to merge")

    def voices(self) -> list[str]:
        """The voice names this stage can speak with ([] = it has no voices).

        The ingress validates a request's voice against these before any stage runs, so an
        engine never sees a voice outside this list (matching is case-insensitive).
        """
        return []

    def video_rules(self) -> VideoRules | None:
        """What this stage makes of a video request (defaults, limits), for an engine that makes videos; else None.

        The ingress asks once, to check a ``/v1/videos`` job's request before the job is created."""
        return None

    def stats(self) -> dict[str, Any]:
        """Engine-level numbers for metrics and autoscaling (e.g. waiting/running requests)."""
        return {}

    def pace(self, min_step_s: float | None) -> None:
        """Step pacing set at run time (the stage's ``user_config``: omni_serve.graph.settings); None: back to
        ``engine_args.min_step_s``. Calls already running keep the pace they started with."""
        self._set_min_step(float(self.engine_args.get("min_step_s", 0.0)) if min_step_s is None else min_step_s)

    def _set_min_step(self, min_step_s: float) -> None:
        """Families whose steps run in this process take it here; the others pace in engine processes set up at
        start (omni_serve.pacing), so a change would need them restarted."""
        raise ValueError(
            f"user_config.min_step_s: stage '{self.stage_name}' ({type(self).__name__}) paces its steps in its "
            "engine processes, set when they start: set engine_args.min_step_s (restarts the replicas)"
        )


class PacedInProcess:
    """For a family whose steps run in the replica's own process: its ``EngineArgs`` (``self.args``) are read as
    each call starts, so a run-time ``min_step_s`` (StageEngine.pace) is a new copy of them."""

    args: Any

    def _set_min_step(self, min_step_s: float) -> None:
        self.args = self.args.model_copy(update={"min_step_s": min_step_s})
