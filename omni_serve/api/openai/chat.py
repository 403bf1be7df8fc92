"""Chat-completion responses and stream chunks built from stage outputs (pure functions).

Audio in a stream: every audio chunk is its own SSE chunk with ``modality: "audio"``
(vLLM-Omni's tag) and ``delta.audio = {id, data}`` (OpenAI's field), where ``data`` is a
self-contained file in the requested format (a whole WAV/MP3/... per chunk, or raw 16-bit
PCM for ``pcm16``, which is what OpenAI's own streaming audio sends). When text was not
asked for, the text stage's deltas travel as ``delta.audio.transcript``, as OpenAI does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_serve.media.encode import EMPTY_AUDIO_SAMPLE_RATE, AudioFormat, b64, encode_audio
from omni_serve.types import FinishReason, Modality, StageOutput, Usage

AUDIO_TTL_S = 3600


@dataclass
class ChatResult:
    """The merged final outputs of one request.

    Usage and finish reason are the text stage's (the one whose ``final_output`` is text),
    whether or not text was asked for; a graph without one finishes with ``stop``.
    """

    text_stage: str | None
    text: list[str] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)  # uint8 HxWx3
    sample_rate: int | None = None
    finish_reason: FinishReason = FinishReason.STOP
    usage: Usage = field(default_factory=Usage)
    prompt_text: str | None = None

    def add(self, output: StageOutput) -> None:
        if output.text:
            self.text.append(output.text)
        if output.audio is not None:
            self.audio.append(output.audio)
            self.sample_rate = self.sample_rate or output.sample_rate
        self.images.extend(output.images)
        self.prompt_text = self.prompt_text or output.prompt_text
        if output.stage == self.text_stage and output.finished:
            # The orchestrator never relays an aborted call as a finished output.
            assert output.finish_reason is not FinishReason.ABORT, "an aborted stage call reached the reply"
            self.finish_reason = output.finish_reason or FinishReason.STOP
            if output.usage:
                self.usage = output.usage


def usage_json(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def completion(
    request_id: str,
    model: str,
    created: int,
    result: ChatResult,
    modalities: set[Modality],
    audio_format: AudioFormat,
    *,
    prompt_text: bool = False,
) -> dict[str, Any]:
    text = "".join(result.text)
    message: dict[str, Any] = {"role": "assistant", "content": text if Modality.TEXT in modalities else None}
    if Modality.IMAGE in modalities:  # content becomes parts: the text (if any), then each image
        from omni_serve.api.openai.images import content_parts

        parts = [{"type": "text", "text": text}] if text and Modality.TEXT in modalities else []
        message["content"] = parts + content_parts(result.images)
    if Modality.AUDIO in modalities:
        samples = np.concatenate(result.audio) if result.audio else np.zeros(0, dtype=np.float32)
        rate = result.sample_rate or EMPTY_AUDIO_SAMPLE_RATE
        message["audio"] = {
            "id": f"audio-{request_id}",
            "data": b64(encode_audio(samples, rate, audio_format)),
            "expires_at": int(time.time()) + AUDIO_TTL_S,
            "transcript": text,
        }
    body = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": result.finish_reason.value, "logprobs": None}],
        "usage": usage_json(result.usage),
    }
    if prompt_text:
        body["prompt_text"] = result.prompt_text
    return body


def chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    *,
    finish_reason: FinishReason | None = None,
    modality: Modality | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason.value if finish_reason else None}],
    }
    if modality is not None:
        body["modality"] = modality.value
    return body


def audio_delta(request_id: str, output: StageOutput, audio_format: AudioFormat) -> dict[str, Any]:
    assert output.audio is not None and output.sample_rate, "an audio output carries its sample rate"
    data = encode_audio(output.audio, output.sample_rate, audio_format)
    return {"audio": {"id": f"audio-{request_id}", "data": b64(data)}}


def transcript_delta(request_id: str, text: str) -> dict[str, Any]:
    return {"audio": {"id": f"audio-{request_id}", "transcript": text}}


def usage_chunk(request_id: str, model: str, created: int, usage: Usage) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(usage),
    }


def sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, separators=(',', ':'))}\n\n"
