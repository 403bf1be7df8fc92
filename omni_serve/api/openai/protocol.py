"""Request models of the OpenAI-compatible API (pydantic; unknown fields are rejected).

Fields OpenAI clients commonly send but that do not change our output are accepted
and ignored (``user``, ``metadata``, penalties at their neutral value, ...); fields
that would change the output and that we cannot honour are rejected with a message,
so nothing is silently dropped.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_serve import types
from omni_serve.api.errors import APIError, bad_request
from omni_serve.media import inputs as media_input
from omni_serve.media.encode import AudioFormat
from omni_serve.media.policy import MediaPolicy, check_url
from omni_serve.types import SAMPLING_EXTENSIONS, ChatMessage, Modality

if TYPE_CHECKING:
    from starlette.requests import Request

# Generation lengths above this are refused outright (stages also cap at their context).
MAX_TOKENS_LIMIT = 1 << 20


# ---- the wire: body bytes -> JSON object ----------------------------------------------------


def check_content_type(content_type: str | None) -> None:
    """JSON bodies only; a missing header is tolerated (some clients omit it)."""
    if not content_type:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json (got '{media:.60}')", type="invalid_request_error")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes (never buffered whole)."""
    too_large = APIError(413, f"request body over {limit} bytes", type="invalid_request_error")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body; every malformed body is a 400 naming what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad_request(f"request body is not valid UTF-8 (byte {err.start})") from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise bad_request(f"request body is not valid JSON: {err.msg} at position {err.pos}") from None
    except RecursionError:
        raise bad_request("request body is not valid JSON: nested too deeply") from None
    except ValueError as err:  # e.g. an integer literal longer than Python's digit limit
        raise bad_request(f"request body is not valid JSON: {str(err)[:120]}") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, not {type(data).__name__}")
    return data


def api_key_matches(authorization: str | None, api_key: str) -> bool:
    """``Authorization: Bearer <key>`` (scheme case-insensitive), compared in constant time."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _valid_unicode(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} contains an unpaired UTF-16 surrogate escape") from None
    return text


# ---- request models ---------------------------------------------------------------------------

# vLLM SamplingParams' ``detokenize`` decides only whether vLLM reports text for a stage; accepted in
# stage_sampling / sampling_params_list entries (vLLM-Omni's example client sends it), ignored.
_VLLM_REPORTING_FIELDS = frozenset({"detokenize"})


def sampling_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """One stage's overrides as the client sent them (our names, or vLLM SamplingParams' names) -> ours.

    vLLM's ``top_k: -1`` (no top-k filtering) is our 0; other unknown fields are kept, so that
    validation refuses them by name.
    """
    overrides = {k: v for k, v in values.items() if k not in _VLLM_REPORTING_FIELDS}
    if overrides.get("top_k") == -1:
        overrides["top_k"] = 0
    return overrides


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _unicode(cls, text: str) -> str:
        return _valid_unicode(text, "text")


class MediaURL(_Strict):
    url: str = Field(description="A data URL (data:<type>;base64,...), or an http(s)/file URL the media policy allows.")


class ImageURL(MediaURL):
    detail: Literal["auto"] | None = Field(None, description="Only 'auto': the model's processor sets the resolution.")


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class AudioURLPart(_Strict):
    type: Literal["audio_url"]
    audio_url: MediaURL


class VideoURLPart(_Strict):
    type: Literal["video_url"]
    video_url: MediaURL


class InputAudio(_Strict):
    data: str = Field(description="Base64 of the encoded audio file.")
    format: Literal["wav", "mp3", "flac", "ogg", "opus", "aac", "m4a", "webm"]


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FilePart(BaseModel):
    """OpenAI's file parts are recognised so they can be refused with a clear message."""

    model_config = ConfigDict(extra="allow")
    type: Literal["file"]


MediaContentPart = ImageURLPart | AudioURLPart | VideoURLPart | InputAudioPart
ContentPart = Annotated[TextPart | MediaContentPart | FilePart, Field(discriminator="type")]
_KIND = {"image_url": "image", "audio_url": "audio", "input_audio": "audio", "video_url": "video"}


@dataclass(frozen=True)
class MediaRules:
    """What the graph accepts as media input, and under which policy and limits."""

    accepts: frozenset[str]  # the entry stage's input modalities ("text" always)
    policy: MediaPolicy
    limits: media_input.MediaInputConfig


def _media_part(part: MediaContentPart, param: str, rules: MediaRules, audio_in_video: bool) -> types.MediaPart:
    """The cheap ingress checks of one media part; the bytes of a data URL ride along (not decoded)."""
    kind = _KIND[part.type]
    if kind not in rules.accepts:
        offered = ", ".join(sorted(rules.accepts))
        raise bad_request(f"{param}: '{part.type}' input is not supported by this graph (it takes {offered})", param)
    max_bytes = rules.limits.max_bytes
    if isinstance(part, InputAudioPart):
        data = media_input.base64_bytes(part.input_audio.data, param, max_bytes)
        media_input.check_format(data, kind, param, declared=part.input_audio.format)
        return types.MediaPart(type=kind, param=param, data=data)
    url = (part.image_url if isinstance(part, ImageURLPart) else getattr(part, part.type)).url.strip()
    if url[:5].lower() == "data:":
        data = media_input.data_url_bytes(url, param, max_bytes)
        media_input.check_format(data, kind, param)
        return types.MediaPart(type=kind, param=param, data=data, audio_in_video=audio_in_video and kind == "video")
    check_url(url, param, rules.policy)
    return types.MediaPart(type=kind, param=param, url=url, audio_in_video=audio_in_video and kind == "video")


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _unicode(cls, content: Any) -> Any:
        return _valid_unicode(content, "content") if isinstance(content, str) else content

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None or self.content == []:
            raise ValueError("content: a message needs content")
        return self

    def chat_message(self, index: int, rules: MediaRules, audio_in_video: bool = False) -> ChatMessage:
        """The turn for the entry stage; ``index`` (its position in ``messages``) names a refused part.

        Text-only turns become one string; a turn with media keeps its parts in order.
        """
        if isinstance(self.content, str):
            return ChatMessage(role=self.role, content=self.content)
        parts: list[types.TextPart | types.MediaPart] = []
        for j, part in enumerate(self.content or []):
            param = f"messages.{index}.content.{j}"
            if isinstance(part, TextPart):
                parts.append(types.TextPart(text=part.text))
            elif isinstance(part, FilePart):
                raise bad_request(f"{param}: 'file' input is not supported by this graph", param)
            elif self.role != "user" and _KIND[part.type] in rules.accepts:
                raise bad_request(f"{param}: media parts are accepted in user messages only", param)
            else:
                parts.append(_media_part(part, param, rules, audio_in_video))
        if all(isinstance(p, types.TextPart) for p in parts):
            return ChatMessage(role=self.role, content="".join(p.text for p in parts))
        return ChatMessage(role=self.role, content=parts)


class MMProcessorKwargs(_Strict):
    """vLLM-Omni's per-request processor options this server honours (others are refused by name)."""

    use_audio_in_video: bool = Field(False, description="A video's audio track is input too, interleaved in time.")


ChatAudioFormat = Literal["wav", "mp3", "flac", "opus", "aac", "pcm16", "pcm"]


class AudioOptions(_Strict):
    voice: str | None = Field(None, description="Voice name or OpenAI alias; None uses the model's default voice.")
    format: ChatAudioFormat = Field("wav", description="Container of message.audio.data; pcm16 = raw 16-bit PCM.")

    @property
    def container(self) -> AudioFormat:
        return "pcm" if self.format == "pcm16" else self.format


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
    top_k: int | None = Field(None, ge=-1, description="vLLM's -1, like 0, means no top-k filtering.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    n: Literal[1] = 1
    # vLLM's extra sampling parameters (its OpenAI server accepts them at the top level; `vllm bench
    # serve` sends ignore_eos). They apply to the entry stage; types.SamplingParams has their meaning.
    # A stage whose engine cannot honour one that is sent refuses it with a 400 naming it.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    stage_sampling: dict[str, dict[str, Any]] | None = Field(
        None, description="Per-stage sampling overrides keyed by stage name, e.g. {'talker': {'temperature': 0.9}}."
    )
    # vLLM-Omni's extensions, with its meaning (its example clients send them).
    sampling_params_list: list[dict[str, Any]] | None = Field(
        None, description="Per-stage vLLM SamplingParams by stage position (the graph's stage order)."
    )
    voice: str | None = Field(None, description="The voice, as vLLM-Omni accepts it at the top level.")
    speaker: str | None = Field(None, description="vLLM-Omni's name for voice.")
    return_prompt_text: bool | None = Field(None, description="Add the templated prompt as 'prompt_text'.")
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # Accepted for vLLM-Omni clients; they do not change this graph's output: vLLM-Omni's Qwen3-Omni
    # path drops language and instructions too (they are read by its TTS-model paths).
    language: str | None = None
    instructions: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        values = [stop] if isinstance(stop, str) else stop or []
        if len(values) > 4 or any(not s for s in values):
            raise ValueError("at most 4 non-empty stop strings")
        return stop

    @field_validator("stage_sampling")
    @classmethod
    def _stage_max_tokens(cls, per_stage: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
        for stage, values in (per_stage or {}).items():
            limit = values.get("max_tokens")
            if isinstance(limit, int | float) and limit > MAX_TOKENS_LIMIT:
                raise ValueError(f"{stage}.max_tokens: must be at most {MAX_TOKENS_LIMIT}")
        return per_stage

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, modalities: list[Modality] | None) -> list[Modality] | None:
        if modalities is not None and not modalities:
            raise ValueError("must name at least one modality")
        return modalities

    @field_validator("sampling_params_list")
    @classmethod
    def _list_max_tokens(cls, per_stage: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, values in enumerate(per_stage or []):
            limit = values.get("max_tokens")
            if isinstance(limit, int | float) and limit > MAX_TOKENS_LIMIT:
                raise ValueError(f"{i}.max_tokens: must be at most {MAX_TOKENS_LIMIT}")
        return per_stage

    @model_validator(mode="after")
    def _one_voice(self) -> ChatCompletionRequest:
        if len({v.lower() for v in self._voices().values()}) > 1:
            raise ValueError(f"{', '.join(self._voices())} name different voices; send one")
        if self.stage_sampling is not None and self.sampling_params_list is not None:
            raise ValueError("stage_sampling and sampling_params_list are two forms of the same thing; send one")
        return self

    def _voices(self) -> dict[str, str]:
        named = {"audio.voice": self.audio.voice if self.audio else None, "voice": self.voice, "speaker": self.speaker}
        return {field: voice for field, voice in named.items() if voice}

    def requested_voice(self) -> tuple[str | None, str]:
        """The voice the client named (OpenAI's ``audio.voice`` or vLLM-Omni's ``voice``/``speaker``) and its field."""
        field, voice = next(iter(self._voices().items()), ("audio.voice", None))
        return voice, field

    def chat_messages(self, rules: MediaRules) -> list[ChatMessage]:
        """The turns for the entry stage, media checked under ``rules`` (their bytes not decoded here)."""
        audio_in_video = bool(self.mm_processor_kwargs and self.mm_processor_kwargs.use_audio_in_video)
        messages = [m.chat_message(i, rules, audio_in_video) for i, m in enumerate(self.messages)]
        parts = [p for m in messages for p in m.media()]
        if len(parts) > rules.limits.max_parts:
            extra = parts[rules.limits.max_parts].param
            raise bad_request(
                f"{extra}: more than {rules.limits.max_parts} media parts in one request (media_input.max_parts)",
                extra,
            )
        return messages

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def entry_sampling(self) -> dict[str, Any]:
        """The top-level sampling fields the client sent, by ``types.SamplingParams`` name (entry stage)."""
        sent = {name: getattr(self, name) for name in _TOP_LEVEL_SAMPLING}
        sent["max_tokens"] = self.max_completion_tokens or self.max_tokens
        sent["stop"] = self.stop_list or None
        if sent["top_k"] == -1:
            sent["top_k"] = 0
        return {name: value for name, value in sent.items() if value is not None}


# Top-level request fields that are also types.SamplingParams fields of the same name.
_TOP_LEVEL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    *(name for name in ChatCompletionRequest.model_fields if name in SAMPLING_EXTENSIONS or name == "stop_token_ids"),
)
