"""Request models of the OpenAI-compatible API (pydantic; unknown fields are rejected).

Fields OpenAI clients commonly send but that do not change our output are accepted
and ignored (``user``, ``metadata``, penalties at their neutral value, ...); fields
that would change the output and that we cannot honour are rejected with a message,
so nothing is silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_serve.types import Modality


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """Image/audio/video parts are recognised so they can be refused with a clear message."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "audio_url", "video_url", "file"]


ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None or self.content == []:
            raise ValueError("content: a message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content or []:
            if isinstance(part, MediaPart):
                raise ValueError(f"content: '{part.type}' input is not supported by this graph (text only)")
            parts.append(part.text)
        return "".join(parts)


class AudioOptions(_Strict):
    voice: str | None = Field(None, description="Speaker name; None uses the model's default voice.")
    format: Literal["wav", "pcm", "flac"] = Field("wav", description="Container of message.audio.data.")


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    modalities: list[Modality] | None = Field(None, description="Default ['text'].")
    audio: AudioOptions | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    n: Literal[1] = 1
    stage_sampling: dict[str, dict[str, Any]] | None = Field(
        None, description="Per-stage sampling overrides keyed by stage name, e.g. {'talker': {'temperature': 0.9}}."
    )
    # Accepted for client compatibility; they do not change the output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    frequency_penalty: Literal[0, 0.0] | None = None
    presence_penalty: Literal[0, 0.0] | None = None
    logprobs: Literal[False] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        values = [stop] if isinstance(stop, str) else stop or []
        if len(values) > 4 or any(not s for s in values):
            raise ValueError("at most 4 non-empty stop strings")
        return stop

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, modalities: list[Modality] | None) -> list[Modality] | None:
        if modalities is not None and not modalities:
            raise ValueError("must name at least one modality")
        return modalities

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
