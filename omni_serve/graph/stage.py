"""The stage deployment: one engine, its inputs resolved from the object store.

A stage knows nothing about HTTP. It takes its inputs out of the object store itself
(so a payload moves object store -> this replica, never through the ingress), runs its
engine, and yields any handoff the engine produces as its own stream item, owned by the
caller: both sides of that are :mod:`omni_serve.graph.transport`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve

from omni_serve.engines import create_engine
from omni_serve.graph.coalesce import coalesced
from omni_serve.graph.config import StageConfig
from omni_serve.graph.cycles import collect_soon
from omni_serve.graph.flow import Sent, output_bytes
from omni_serve.graph.metrics import StageMetrics
from omni_serve.graph.settings import StageSettings, parse
from omni_serve.graph.transport import receive, stream_items
from omni_serve.media.inputs import MediaInputConfig, load_media
from omni_serve.media.inputs import decodes as media_decodes
from omni_serve.media.policy import MediaPolicy
from omni_serve.payload import HandoffPayload, payload_loads
from omni_serve.types import FinishReason, MediaPart, StageOutput, StageRequest, VideoRules

logger = logging.getLogger("ray.serve")

# How long one stage call may hold text deltas per call in flight in the replica (omni_serve.graph.coalesce):
# the replica then sends on the order of 1 / COALESCE_S_PER_CALL text items per second in all.
COALESCE_S_PER_CALL = 0.01


def _outcome(final: StageOutput | None) -> str:
    return "ok" if final is not None and final.finish_reason is not FinishReason.ABORT else "error"


class Stage:
    """One stage's engine and its calls; a Serve deployment of its own (:class:`StageDeployment`), or
    inside the ingress replica when the graph says ``engine_in_ingress`` (one Python hop less)."""

    def __init__(self, stage: dict[str, Any], media: dict[str, Any] | None = None):
        self.config = StageConfig.model_validate(stage)
        self.name = self.config.name
        # Entry stage only: the requests' media policy and limits (it fetches and decodes their media).
        self.media = (
            (MediaPolicy.model_validate(media["policy"]), MediaInputConfig.model_validate(media["input"]))
            if media
            else None
        )
        self.calls = 0
        self.in_flight = 0
        self.items = 0  # stream items yielded since start (tests and the README's per-request counts)
        self.max_coalesce_s = self.config.max_coalesce_ms / 1000
        self.metrics = StageMetrics()
        self.engine = create_engine(self.config.engine, self.name, self.config.engine_args)
        self.engine.stream_input = self.config.stream_input
        self._paced = False  # pacing set by the deployment's user_config (configure)
        self.padding = self.config.handoff_padding_bytes

    async def start(self) -> None:
        started = time.perf_counter()
        await self.engine.start()
        logger.info(
            "stage %s ready: engine=%s args=%s load=%.1fs",
            self.name,
            self.config.engine,
            self.config.engine_args,
            time.perf_counter() - started,
        )

    async def generate(self, request: StageRequest) -> AsyncGenerator[StageOutput | HandoffPayload, None]:
        """Run one stage call. Outcomes are counted as they happened:

        ``ok`` the engine yielded its finished output (also when the caller then closed the
        call before this generator returned: nothing is left to abort), ``cancelled`` the
        caller left before it, ``error`` anything else, including an engine that finished
        with ABORT although nobody cancelled the call (the orchestrator fails the request).
        """
        self.calls += 1
        started = time.time()
        if request.sent_at:
            self.metrics.queue_wait.observe(max(0.0, started - request.sent_at))
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        outcome = "error"
        finished: StageOutput | None = None
        stream: AsyncGenerator[StageOutput, None] | None = None
        outputs: AsyncGenerator[StageOutput, None] | None = None
        sent = Sent(request.window)  # what this call yielded, against what its caller took
        request.window = None
        try:
            inputs = await receive(request)
            if inputs.media:
                request.media = await self._decoded(inputs.media)
            handoff = inputs.handoff
            if handoff is not None and not isinstance(handoff, HandoffPayload):  # a streamed call's chunks
                request.handoff_stream, handoff = handoff, None
            request.handoffs = inputs.handoffs  # a fan-in call's (in this process now)
            stream = self.engine.generate(request, handoff)  # aborts its engine work when cancelled
            merge = self.engine.merge_handoffs if request.stream_handoff else None
            outputs = coalesced(
                stream, self._coalesce_interval, merge_handoffs=merge, handoff_interval=self.max_coalesce_s
            )
            padding = self.padding
            async for output in outputs:
                self.metrics.output(output)
                finished = output if output.finished else finished
                items = stream_items(output, request.wants_handoff, padding)
                if request.stream_handoff and len(items) > 1:
                    padding = 0  # a streamed handoff is padded once, on its first chunk: the same bytes as whole
                # A window ahead of the caller: wait here (so the engine is not pulled either).
                await sent.admit(len(items), output_bytes(output))
                for item in items:
                    self.items += 1
                    yield item
            outcome = _outcome(finished)
        except (asyncio.CancelledError, GeneratorExit):
            if finished is not None:  # closed after its final output: a completed call, nothing to abort
                outcome = _outcome(finished)
            else:  # client gone or orchestrator gave up: engine.generate frees the engine's slot
                outcome = "cancelled"
                collect_soon()  # what the cancellation left in cycles holds borrowed handoffs (graph.cycles)
                logger.info(
                    "stage %s: call %s (X-Request-ID %s) cancelled",
                    self.name,
                    request.request_id,
                    request.client_request_id,
                )
            raise
        finally:
            sent.close()
            if outputs is not None:
                await outputs.aclose()
            if stream is not None:
                await stream.aclose()
            chunks, request.handoff_stream = request.handoff_stream, None
            if chunks is not None:  # its reader's last take holds chunk refs until the stream is closed
                with contextlib.suppress(RuntimeError):  # still running in an engine's task: that task ends it
                    await chunks.aclose()
            if outcome == "error":
                collect_soon()  # a failure kept by an engine (a fed talker's queued one) is in a cycle with its frames
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
            self.metrics.processing.observe(time.time() - started)
            self.metrics.calls.inc(tags={"outcome": outcome})

    async def _decoded(self, parts: list[MediaPart]) -> list[Any]:
        """The request's media fetched (URLs, under the media policy) and decoded, in message order."""
        if self.media is None:
            raise TypeError(f"stage {self.name} is not the entry stage: it takes no media")
        policy, config = self.media
        return await load_media(parts, policy, config, self.engine.audio_input_rate)

    def _coalesce_interval(self) -> float:
        return min(COALESCE_S_PER_CALL * self.in_flight, self.max_coalesce_s)

    def shutdown(self) -> None:
        """Stop the engine (once): engines with child processes stop them here."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        self.shutdown()  # Serve calls __del__ when the replica stops

    def configure(self, user_config: Any) -> None:
        """The deployment's run-time settings (omni_serve.graph.settings); None: the engine_args' values."""
        settings = parse(StageSettings, user_config, self.name)
        if settings.min_step_s is not None or self._paced:  # untouched pacing stays as the engine started
            self.engine.pace(settings.min_step_s)  # refused where the engine paces in its own processes
            self._paced = settings.min_step_s is not None
        padding = settings.handoff_padding_bytes
        self.padding = self.config.handoff_padding_bytes if padding is None else padding

    async def check_health(self) -> None:
        await self.engine.check_health()

    def voices(self) -> list[str]:
        """The engine's voice names; the ingress asks once and validates requests against them."""
        return self.engine.voices()

    def video_rules(self) -> VideoRules | None:
        """What the engine makes of a video request; the ingress asks once and checks video jobs against it."""
        return self.engine.video_rules()

    def stats(self) -> dict[str, Any]:
        """Calls served by this replica plus engine stats (tests and autoscaling read these)."""
        return {
            "stage": self.name,
            "calls": self.calls,
            "in_flight": self.in_flight,
            "items": self.items,
            "payload_loads": payload_loads(),
            "media_decodes": media_decodes(),
            **self.engine.calls.stats(),  # live engine requests and aborts: what every family tracks
            **self.engine.stats(),
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook: the engine queue (``engine_waiting``/``_running``) for the stage policy.

        Only the numbers the engine reports are sent (an engine that reports neither: this is empty). Serve still
        asks a replica that is stopping, after :meth:`shutdown` let its engine go: empty too, not an error.
        """
        engine = self.__dict__.get("engine")
        stats = engine.stats() if engine is not None else {}
        return {
            f"engine_{key}": float(value)
            for key in ("waiting", "running")
            if isinstance(value := stats.get(key), (int, float)) and not isinstance(value, bool)
        }


@serve.deployment(
    # Engines batch internally, so a replica takes several requests at once; the
    # graph file's `deployments:` entry overrides these defaults.
    max_ongoing_requests=16,
    # Bounded queue per caller: overload answers 503 + Retry-After instead of growing memory.
    max_queued_requests=64,
    ray_actor_options={"num_cpus": 0.25},
    health_check_period_s=5,
)
class StageDeployment(Stage):
    """The stage as its own Serve deployment: its replicas, resources and autoscaling are its own."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, stage: dict[str, Any], media: dict[str, Any] | None = None
    ):
        super().__init__(stage, media)
        await self.start()

    def reconfigure(self, user_config: Any, rank: Any = None) -> None:
        """Serve's hook for the deployment's ``user_config``, applied to this running replica (no restart). Taking
        ``rank`` makes Serve call it also when the user_config is removed, which restores the engine_args'."""
        self.configure(user_config)
