"""The Realtime protocol's events, as OpenAI's GA API names and shapes them.

The reference is the official ``openai`` package's ``openai.types.realtime`` (client events in
``realtime_client_event.py``, server events in ``realtime_server_event.py``). Client events are
validated here with pydantic models of the fields omni_serve reads. A field of OpenAI's that would change
the reply and cannot be honoured here (``include``, ``prompt``, ``reasoning``, noise reduction, a speed
other than 1, a response's own ``input``) is refused with an ``error`` naming it (:data:`Refused`);
``tracing`` and ``truncation`` (OpenAI's own dashboards, and a context policy omni_serve's history rules
replace: docs/realtime.md) are accepted; a field the GA API does not have is ignored, so a client built for
a newer API still connects. Server events are plain dicts built by :func:`server_event`.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from omni_serve.api.openai.errors import APIError, bad_request, from_validation
from omni_serve.api.openai.tools import FUNCTION_NAME
from omni_serve.api.openai.transcriptions import Language, Prompt
from omni_serve.api.realtime.tools import MAX_TOOLS, ToolChoice, Tools
from omni_serve.types import MAX_TOKENS_LIMIT

# OpenAI's only rate for audio/pcm; the thinker's input and code2wav's output rate of Qwen3-Omni.
PCM_RATE = 24000


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _refused(why: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if value not in (None, [], {}):
            raise ValueError(why)
        return value

    return AfterValidator(check)


# OpenAI's fields that would change the reply and that omni_serve cannot honour: absent, null or empty only.
Refused = {
    "include": "omni_serve's transcriptions carry no logprobs; send no include",
    "prompt": "omni_serve has no stored prompts; send the instructions themselves",
    "reasoning": "the served models have no reasoning effort to set",
    "noise_reduction": "omni_serve applies no noise reduction to input audio; send null",
    "input": "responses run over the conversation (or none, with conversation: none); input item lists are "
    "not supported",
}


Include = Annotated[Any, _refused(Refused["include"])]
StoredPrompt = Annotated[Any, _refused(Refused["prompt"])]
Reasoning = Annotated[Any, _refused(Refused["reasoning"])]
NoiseReduction = Annotated[Any, _refused(Refused["noise_reduction"])]
ResponseInput = Annotated[Any, _refused(Refused["input"])]


def _speed_one(speed: float | None) -> float | None:
    if speed not in (None, 1.0):
        raise ValueError("only 1.0: the talker speaks at its own pace")
    return speed


class AudioFormat(_Lenient):
    type: Literal["audio/pcm"] = Field(
        "audio/pcm", description="Only 16-bit little-endian mono PCM (audio/pcmu and audio/pcma are refused)."
    )
    rate: Literal[24000] = Field(24000, description="Only 24 kHz.")


class TurnDetection(_Lenient):
    type: Literal["server_vad"] = Field("server_vad", description="semantic_vad is refused (no semantic model).")
    threshold: float = Field(0.5, ge=0.0, le=1.0, description="Silero's speech probability threshold.")
    prefix_padding_ms: int = Field(300, ge=0, le=10_000, description="Audio kept before detected speech.")
    silence_duration_ms: int = Field(500, ge=0, le=10_000, description="Silence that ends a turn.")
    create_response: bool = Field(True, description="Start a response when a turn ends.")
    interrupt_response: bool = Field(True, description="Speech during a response cancels it (barge-in).")


class Transcription(_Lenient):
    model: str | None = None
    language: Language | None = None
    prompt: Prompt | None = None


class AudioInput(_Lenient):
    format: AudioFormat | None = None
    turn_detection: TurnDetection | None = None  # null: manual turns (commit + response.create)
    transcription: Transcription | None = None
    noise_reduction: NoiseReduction = None


class AudioOutput(_Lenient):
    format: AudioFormat | None = None
    voice: str | None = None
    speed: Annotated[float | None, AfterValidator(_speed_one)] = None


class SessionAudio(_Lenient):
    input: AudioInput | None = None
    output: AudioOutput | None = None


Modalities = Annotated[list[Literal["text", "audio"]], Field(min_length=1, max_length=1)]


def _max_tokens(value: int | str) -> int | str:
    if isinstance(value, int) and not 1 <= value <= MAX_TOKENS_LIMIT:  # the chat route's bounds
        raise ValueError(f"must be 'inf' or from 1 to {MAX_TOKENS_LIMIT}")
    return value


MaxTokens = Annotated[int | Literal["inf"], AfterValidator(_max_tokens)]


class SessionConfig(_Lenient):
    type: Literal["realtime"] = "realtime"
    model: str | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    audio: SessionAudio | None = None
    max_output_tokens: MaxTokens | None = None
    tools: Tools | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include: Include = None
    prompt: StoredPrompt = None
    reasoning: Reasoning = None
    # Accepted: OpenAI's trace dashboards, and its context-overflow policy (omni_serve's history rules apply).
    tracing: Any = None
    truncation: Any = None


class ContentPart(_Lenient):
    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text", "audio"]
    text: str | None = None
    audio: str | None = None  # base64 pcm16 24 kHz
    transcript: str | None = None


class Item(_Lenient):
    """A conversation item: a message, a function call (a client may send an earlier call back) or a call's
    output (``function_call_output``: what the client's tool returned, for the next response)."""

    id: str | None = Field(None, max_length=64)
    type: Literal["message", "function_call", "function_call_output"]
    role: Literal["user", "assistant", "system"] | None = None
    content: list[ContentPart] = Field(default_factory=list)
    call_id: str | None = Field(None, min_length=1, max_length=64)
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    arguments: str | None = None
    output: str | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> Item:
        needs = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments")}
        for name in needs.get(self.type, ("call_id", "output")):
            if getattr(self, name) in (None, []):
                raise ValueError(f"{name}: a {self.type} item needs it")
        return self


class AudioOutputOverride(_Lenient):
    voice: str | None = None
    format: AudioFormat | None = None
    speed: Annotated[float | None, AfterValidator(_speed_one)] = None


class ResponseAudio(_Lenient):
    output: AudioOutputOverride | None = None


class ResponseParams(_Lenient):
    instructions: str | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxTokens | None = None
    audio: ResponseAudio | None = None
    conversation: Literal["auto", "none"] = "auto"
    metadata: dict[str, str] | None = None
    tools: Tools | None = Field(None, max_length=MAX_TOOLS, description="Replace the session's for this response.")
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    input: ResponseInput = None
    prompt: StoredPrompt = None
    reasoning: Reasoning = None
    # omni_serve's extensions, with their chat-completions meaning (benchmarks and tests pin sampling).
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Every stage's seed.")
    stage_sampling: dict[str, dict[str, Any]] | None = Field(
        None, description="Per-stage sampling overrides by stage name, as in chat completions."
    )


class _Event(_Lenient):
    event_id: str | None = Field(None, max_length=512)


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionConfig


class BufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class BufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class BufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: Item


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


class OutputAudioClear(_Event):
    type: Literal["output_audio_buffer.clear"]


ClientEvent = (
    SessionUpdate
    | BufferAppend
    | BufferCommit
    | BufferClear
    | ItemCreate
    | ItemTruncate
    | ItemDelete
    | ItemRetrieve
    | ResponseCreate
    | ResponseCancel
    | OutputAudioClear
)
_BY_TYPE: dict[str, type[_Event]] = {get_args(m.model_fields["type"].annotation)[0]: m for m in get_args(ClientEvent)}
CLIENT_EVENT_TYPES = sorted(_BY_TYPE)


def parse_client_event(data: Any) -> ClientEvent:
    """One decoded JSON value as a client event; an :class:`APIError` naming the field otherwise."""
    if not isinstance(data, dict):
        raise bad_request("an event is a JSON object")
    kind = data.get("type")
    model = _BY_TYPE.get(kind) if isinstance(kind, str) else None  # a list or an object is unhashable: not a type
    if model is None:
        shown = f"{data.get('type')!r:.80}" if "type" in data else "missing"
        raise APIError(
            400, f"type: unknown event type ({shown})", type="invalid_request_error", param="type", code="unknown_event"
        )
    try:
        return model.model_validate(data)  # type: ignore[return-value]
    except ValidationError as err:
        raise from_validation(err) from None


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": f"event_{uuid.uuid4().hex[:20]}", **fields}


def server_event_text(kind: str, name: str, value: str) -> str:
    """A server event as JSON text, its field ``name`` the JSON text ``value`` (serialized once, sent as is)."""
    head = json.dumps(server_event(kind), separators=(",", ":"))
    return f'{head[:-1]},"{name}":{value}}}'


def error_event(error: APIError, client_event_id: str | None) -> dict[str, Any]:
    """OpenAI's ``error`` event: the error object, naming the client's ``event_id`` and the field."""
    body = error.body()["error"]
    return server_event("error", error={**body, "event_id": client_event_id})
