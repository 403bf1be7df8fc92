"""One client request as the graph runs it: what a route builds from its validated body.

Its own module, below the orchestrator, so that the OpenAI routes (:mod:`omni_serve.api.openai`, which
import no Ray) can build it beside their replies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omni_serve.types import ChatMessage, ImageParams, Modality, SamplingParams, ToolCalling, VideoParams

if TYPE_CHECKING:
    from omni_serve.graph.stage_log import StageLog


@dataclass
class OmniRequest:
    """What the ingress hands the orchestrator: one client request, already validated."""

    request_id: str  # minted by the server; stage call ids derive from it
    modalities: set[Modality]
    sampling: dict[str, SamplingParams]  # resolved per stage
    messages: list[ChatMessage] | None = None
    voice: str | None = None  # already validated against the graph's voices
    image: ImageParams | None = None
    video: VideoParams | None = None
    text_to_speak: str | None = None  # text-to-speech: the entry stage speaks this instead of generating
    speech: dict[str, Any] | None = None  # text-to-speech: a TTS model's voice-mode fields (StageRequest.speech)
    client_request_id: str | None = None  # the client's X-Request-ID: a label for logs, never a key
    deadline: float | None = None  # time.monotonic() by which the whole walk must be done
    return_prompt_text: bool = False
    tools: ToolCalling | None = None  # tools the entry stage may call (chat's tools / tool_choice)
    # Every stage call's start and every output of every stage, recorded as they pass (vLLM-Omni's
    # return_stage_metrics); None records nothing.
    stage_log: StageLog | None = None
