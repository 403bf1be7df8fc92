"""What a session uses of its ingress (:class:`SessionGraph`): the graph's facts, the one way to run a
request, the replica's sessions and VAD threads. The session's parts take it from here, so that none of
them imports the session itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from omni_serve.api.openai.sampling import SamplingRequest
from omni_serve.api.realtime.admission import Sessions
from omni_serve.api.realtime.vad import VadWorkers
from omni_serve.graph.config import RealtimeConfig
from omni_serve.graph.request import OmniRequest
from omni_serve.graph.stage_log import StageLog
from omni_serve.types import SamplingParams, StageOutput


@dataclass(frozen=True)
class SessionGraph:
    """What a session uses of its ingress: the graph's facts, the one way to run a request, the replica's sessions."""

    model: str
    outputs: Callable[[OmniRequest, str], AsyncIterator[StageOutput]]  # Serving.outputs
    sampling: Callable[[SamplingRequest], dict[str, SamplingParams]]  # StageSampling.for_request
    voice: Callable[[str, str], Awaitable[str | None]]  # (name, param) -> the graph's voice, or a 400
    stage_log: Callable[[], StageLog]  # a fresh log for one request (what its stages did)
    text_stage: str | None
    speaks: bool  # the graph has an audio final output
    takes_audio: bool  # the entry stage takes audio input
    max_audio_parts: int  # media parts one request may carry (media_input.max_parts)
    max_audio_bytes: int
    limits: RealtimeConfig
    sessions: Sessions  # the replica's open sessions (admission)
    vad: VadWorkers  # the replica's VAD threads and models
    unavailable: str | None = None  # why this graph runs no sessions (a TTS model), or None
