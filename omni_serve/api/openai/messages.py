"""Chat messages as clients send them (OpenAI content parts) -> the turns the entry stage takes.

Media parts get their cheap checks here (modality accepted, size, format sniffed, URL under the
media policy); their bytes ride along undecoded (the entry stage decodes them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_serve import types
from omni_serve.api.openai.errors import bad_request
from omni_serve.media import inputs as media_input
from omni_serve.media.policy import MediaPolicy, check_url
from omni_serve.types import ChatMessage


def _valid_unicode(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} contains an unpaired UTF-16 surrogate escape") from None
    return text


def not_blank(text: str) -> str:
    """``text`` if it has something besides whitespace (a prompt or a text to speak of spaces says nothing)."""
    if not text.strip():
        raise ValueError("must not be empty or whitespace only")
    return text


class _Strict(BaseModel):
    """A JSON body's model: unknown fields are refused by name, and types are strict as OpenAI's are ("yes" is no
    boolean, "1" no number, 1 no boolean); an integer is a number, so a float field takes 2 as 2.0 (pydantic's
    strict float, and JSON's). A form's model relaxes the types (:data:`FORM`): a form's values are strings."""

    model_config = ConfigDict(extra="forbid", strict=True)


# The config of a model read from a multipart form: every value arrives as a string, parsed by type.
FORM = ConfigDict(extra="forbid", strict=False)


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
MediaKind = Literal["image", "audio", "video"]
_KIND: dict[str, MediaKind] = {"image_url": "image", "audio_url": "audio", "input_audio": "audio", "video_url": "video"}


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


class CalledFunction(_Strict):
    name: str
    arguments: str = Field(description="The call's arguments as the model wrote them: JSON text.")


class AssistantToolCall(_Strict):
    """One call in an assistant turn of the history (what an earlier reply's ``tool_calls`` held)."""

    id: str
    type: Literal["function"]
    function: CalledFunction

    def template_call(self) -> dict[str, Any]:
        """The call as the chat template takes it: arguments as a JSON object when they parse (vLLM's rule)."""
        arguments: Any = self.function.arguments
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class AudioReference(_Strict):
    """An earlier reply's audio, named by its ``id`` (OpenAI's multi-turn audio). The other fields are the ones
    that reply carried, accepted so a client may send the reply's message back as it came."""

    id: str
    data: str | None = None
    expires_at: int | None = None
    transcript: str | None = None


# Looks up an earlier reply's transcript by its audio id; raises a 400 naming ``param`` when it cannot.
Transcripts = Callable[[str, str], str]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, description="Assistant: the calls that turn made.")
    tool_call_id: str | None = Field(None, description="Tool: the call this message answers.")
    audio: AudioReference | None = Field(None, description="Assistant: an earlier reply, named by its audio id.")

    @field_validator("content")
    @classmethod
    def _unicode(cls, content: Any) -> Any:
        return _valid_unicode(content, "content") if isinstance(content, str) else content

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> Message:
        empty = self.content is None or self.content == []
        if self.role != "assistant" and (self.tool_calls is not None or self.audio is not None):
            raise ValueError(f"{'tool_calls' if self.tool_calls is not None else 'audio'}: assistant messages only")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id: tool messages only")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        if empty and not (self.role == "assistant" and (self.tool_calls or self.audio is not None)):
            raise ValueError("content: a message needs content")
        return self

    def chat_message(
        self, index: int, rules: MediaRules, audio_in_video: bool = False, transcripts: Transcripts | None = None
    ) -> ChatMessage:
        """The turn for the entry stage; ``index`` (its position in ``messages``) names a refused part.

        Text-only turns become one string; a turn with media keeps its parts in order. An assistant turn
        named by its audio id gets that reply's transcript (``transcripts``) as its text.
        """
        calls = [c.template_call() for c in self.tool_calls] if self.tool_calls else None
        # A reply sent back as it came has its text as content and its audio: the content is the turn (the
        # thinker takes an earlier turn as text); the id is looked up only for a turn with no text of its own.
        if self.audio is not None and (self.content is None or self.content == []):
            param = f"messages.{index}.audio.id"
            if transcripts is None:
                raise bad_request(f"{param}: this route keeps no earlier replies", param)
            return ChatMessage(role=self.role, content=transcripts(self.audio.id, param), tool_calls=calls)
        if self.content is None or isinstance(self.content, str):
            return ChatMessage(
                role=self.role, content=self.content or "", tool_calls=calls, tool_call_id=self.tool_call_id
            )
        parts: list[types.TextPart | types.MediaPart] = []
        for j, part in enumerate(self.content):
            param = f"messages.{index}.content.{j}"
            if isinstance(part, TextPart):
                parts.append(types.TextPart(text=part.text))
            elif isinstance(part, FilePart):
                raise bad_request(f"{param}: 'file' input is not supported by this graph", param)
            elif self.role != "user" and _KIND[part.type] in rules.accepts:
                raise bad_request(f"{param}: media parts are accepted in user messages only", param)
            else:
                parts.append(_media_part(part, param, rules, audio_in_video))
        texts = [p.text for p in parts if isinstance(p, types.TextPart)]
        content: str | list[types.TextPart | types.MediaPart] = "".join(texts) if len(texts) == len(parts) else parts
        return ChatMessage(role=self.role, content=content, tool_calls=calls, tool_call_id=self.tool_call_id)


class MMProcessorKwargs(_Strict):
    """vLLM-Omni's per-request processor options this server honours (others are refused by name)."""

    use_audio_in_video: bool = Field(False, description="A video's audio track is input too, interleaved in time.")
