"""A session's conversation: its items (OpenAI's ``realtime.item``: messages, function calls and their outputs)
and the thinker's turns made from them.

User audio is kept as the pcm16 the client sent and goes to the entry stage as a WAV media part
(the same samples behind a WAV header), through the same media path (by reference, decoded by the
entry stage) as a chat request's ``input_audio``. An assistant turn becomes its text: the thinker
takes text for its own past turns.

What a conversation holds is counted in bytes (:meth:`Conversation.nbytes`); to stay within the
session's bound it drops the audio the thinker no longer reads, oldest first
(:meth:`Conversation.drop_unread_audio`): every assistant item's (the thinker reads their text) and
user audio older than the newest ``max_audio_parts`` audio turns (those go as their transcript).
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from omni_serve import types
from omni_serve.api.failure_status import stage_bad_request
from omni_serve.api.openai.errors import bad_request
from omni_serve.api.openai.messages import AssistantToolCall, CalledFunction
from omni_serve.api.realtime.events import PCM_RATE, Item
from omni_serve.exceptions import InvalidStageInput
from omni_serve.media import inputs as media_input
from omni_serve.media.encode import b64
from omni_serve.types import ChatMessage

Role = Literal["user", "assistant", "system", "tool"]  # tool: a function call's output
_CONTENT_TYPES: dict[str, set[str]] = {
    "user": {"input_text", "input_audio"},
    "system": {"input_text"},
    "assistant": {"output_text", "output_audio", "text", "audio"},
}


_FILE_FORMATS = {"wav", "flac", "ogg", "webm", "mp4"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def pcm16_bytes(text: str, param: str, max_bytes: int) -> bytes:
    """Base64 audio in the session's format (pcm16 24 kHz mono): whole samples, not a file in another format."""
    try:
        data = media_input.base64_bytes(text, param, max_bytes)
    except InvalidStageInput as err:
        raise stage_bad_request(err) from None
    # Only files with a magic number: raw PCM may start like an MP3/AAC frame sync (0xFFFx).
    container = media_input.sniff(data[:64])
    if container in _FILE_FORMATS or data.startswith(b"ID3"):
        raise bad_request(
            f"{param}: this is {container} audio; the session's input format is audio/pcm "
            "(raw 16-bit little-endian mono at 24 kHz)",
            param,
        )
    if len(data) % 2:
        raise bad_request(f"{param}: audio/pcm is 16-bit: an odd number of bytes ({len(data)})", param)
    return data


def pcm16_ms(pcm: bytes | bytearray) -> int:
    return len(pcm) // 2 * 1000 // PCM_RATE


def wav_file(pcm: bytes | bytearray) -> bytes:
    """pcm16 24 kHz mono as a WAV file: its 44-byte header and the same samples (nothing re-encoded)."""
    rate, width = PCM_RATE, 2
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI", b"RIFF", 36 + len(pcm), b"WAVE", b"fmt ", 16, 1, 1, rate, rate * width, width, 16,
        b"data", len(pcm),
    )  # fmt: skip
    return header + pcm


@dataclass
class Part:
    type: str
    text: str = ""  # text, or the audio's transcript
    audio: bytes | bytearray = b""  # pcm16 24 kHz (a reply's grows in place: add_audio)
    dropped_ms: int = 0  # the length of audio dropped to keep the session in its bytes (the text stays)

    def add_audio(self, pcm: bytes) -> None:
        """Append a reply's chunk in place: ``bytes +=`` would copy the whole reply so far per chunk."""
        if not isinstance(self.audio, bytearray):
            self.audio = bytearray(self.audio)
        self.audio += pcm

    @property
    def audio_ms(self) -> int:
        return pcm16_ms(self.audio) or self.dropped_ms

    def nbytes(self) -> int:
        return len(self.audio) + len(self.text)


@dataclass
class ConversationItem:
    id: str
    role: Role
    parts: list[Part]
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    type: Literal["message", "function_call", "function_call_output"] = "message"
    call_id: str = ""  # a function call's and its output's
    name: str = ""  # a function call's
    arguments: str = ""  # a function call's: JSON text, as the thinker wrote it
    output: str = ""  # a function call output's

    def nbytes(self) -> int:
        return (
            sum(p.nbytes() for p in self.parts)
            + len(self.call_id)
            + len(self.name)
            + len(self.arguments)
            + len(self.output)
        )

    def json(self, with_audio: bool = False) -> dict[str, Any]:
        head = {"id": self.id, "type": self.type, "object": "realtime.item", "status": self.status}
        if self.type == "function_call":
            return {**head, "call_id": self.call_id, "name": self.name, "arguments": self.arguments}
        if self.type == "function_call_output":
            return {**head, "call_id": self.call_id, "output": self.output}
        content = []
        for part in self.parts:
            body: dict[str, Any] = {"type": part.type}
            if part.type in ("input_audio", "output_audio", "audio"):
                body["transcript"] = part.text or None
                if with_audio:
                    body["audio"] = b64(bytes(part.audio))
            else:
                body["text"] = part.text
            content.append(body)
        return {**head, "role": self.role, "content": content}

    def template_call(self) -> dict[str, Any]:
        """A function call as an assistant turn's ``tool_calls`` entry, as chat hands it to the template."""
        return AssistantToolCall(
            id=self.call_id, type="function", function=CalledFunction(name=self.name, arguments=self.arguments)
        ).template_call()

    def chat_message(self) -> ChatMessage:
        """This item as one of the thinker's turns (assistant audio: its transcript)."""
        if self.type == "function_call_output":
            return ChatMessage(role="tool", content=self.output, tool_call_id=self.call_id)
        if self.role != "user":
            return ChatMessage(role=self.role, content="".join(p.text for p in self.parts))
        content: list[types.TextPart | types.MediaPart] = []
        for j, part in enumerate(self.parts):
            if part.type == "input_audio" and not part.audio:  # dropped (the session's bytes): its transcript
                if part.text:
                    content.append(types.TextPart(text=part.text))
            elif part.type == "input_audio":
                wav = wav_file(part.audio)
                content.append(types.MediaPart(type="audio", param=f"item.{self.id}.content.{j}", data=wav))
            else:
                content.append(types.TextPart(text=part.text))
        return ChatMessage(role="user", content=content)

    def truncate(self, content_index: int, audio_end_ms: int) -> None:
        """Keep ``audio_end_ms`` of the part's audio and the share of its transcript that audio spoke."""
        part = self.parts[content_index]
        total = part.audio_ms  # a part whose audio was dropped keeps its length: its transcript is still cut
        if audio_end_ms > total:
            raise bad_request(f"audio_end_ms: {audio_end_ms} is past the audio's end ({total} ms)", "audio_end_ms")
        keep = audio_end_ms * PCM_RATE // 1000 * 2
        words = part.text.split()
        part.text = " ".join(words[: len(words) * audio_end_ms // total]) if total else ""
        part.audio = part.audio[:keep]


def item_from_client(item: Item, max_audio_bytes: int, takes_audio: bool) -> ConversationItem:
    """A client's ``conversation.item.create`` item, a message's content checked against its role."""
    item_id = item.id or new_id("item")
    if item.type == "function_call":
        assert item.call_id is not None and item.name is not None and item.arguments is not None  # Item checked
        return ConversationItem(
            item_id,
            "assistant",
            [],
            type="function_call",
            call_id=item.call_id,
            name=item.name,
            arguments=item.arguments,
        )
    if item.type == "function_call_output":
        assert item.call_id is not None and item.output is not None
        return ConversationItem(
            item_id, "tool", [], type="function_call_output", call_id=item.call_id, output=item.output
        )
    assert item.role is not None
    parts = []
    for j, content in enumerate(item.content):
        param = f"item.content.{j}"
        if content.type not in _CONTENT_TYPES[item.role]:
            allowed = sorted(_CONTENT_TYPES[item.role])
            raise bad_request(f"{param}.type: a {item.role} message takes {allowed}, not {content.type!r}", param)
        if content.type == "input_audio":
            if not takes_audio:
                raise bad_request(f"{param}: this graph's thinker does not take audio input", param)
            if content.audio is None:
                raise bad_request(f"{param}.audio: input_audio needs audio", f"{param}.audio")
            pcm = pcm16_bytes(content.audio, f"{param}.audio", max_audio_bytes)
            parts.append(Part(content.type, content.transcript or "", pcm))
        elif content.type in ("output_audio", "audio"):
            parts.append(Part(content.type, content.transcript or ""))
        else:
            if content.text is None:
                raise bad_request(f"{param}.text: {content.type} needs text", f"{param}.text")
            parts.append(Part(content.type, content.text))
    return ConversationItem(item_id, item.role, parts)


@dataclass
class Conversation:
    items: list[ConversationItem] = field(default_factory=list)

    def find(self, item_id: str, param: str = "item_id") -> ConversationItem:
        for item in self.items:
            if item.id == item_id:
                return item
        raise bad_request(f"{param}: no item {item_id!r} in the conversation", param)

    def add(self, item: ConversationItem, previous_item_id: str | None = None) -> str | None:
        """Insert ``item`` after ``previous_item_id`` (the end when None); returns the item before it."""
        if any(i.id == item.id for i in self.items):
            raise bad_request(f"item.id: an item {item.id!r} already exists", "item.id")
        if item.type == "function_call_output" and not any(
            i.type == "function_call" and i.call_id == item.call_id for i in self.items
        ):  # an output answers a call (OpenAI's rule for a tool message in chat)
            raise bad_request(f"item.call_id: no function_call item has call_id {item.call_id!r}", "item.call_id")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self.items.index(self.find(previous_item_id, "previous_item_id")) + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def delete(self, item_id: str) -> None:
        self.items.remove(self.find(item_id))

    def nbytes(self) -> int:
        return sum(item.nbytes() for item in self.items)

    def drop_unread_audio(self, need: int, max_audio_parts: int) -> int:
        """Drop the audio the thinker no longer reads, oldest first, until ``need`` bytes are free; the bytes freed."""
        heard = self._user_audio()
        kept = {i.id for i in heard[len(heard) - max_audio_parts :]} if max_audio_parts else set()
        freed = 0
        for item in self.items:
            if freed >= need:
                break
            if item.id in kept:
                continue
            for part in item.parts:
                if part.audio:
                    part.dropped_ms, freed = part.audio_ms, freed + len(part.audio)
                    part.audio = b""
        return freed

    def chat_messages(self, instructions: str | None, max_audio_parts: int) -> list[ChatMessage]:
        """The thinker's turns. A request carries at most ``max_audio_parts`` media parts
        (``media_input.max_parts``): older user audio beyond them goes as its transcript, if it has one."""
        audio_items = self._user_audio()
        as_text = {i.id for i in audio_items[: max(0, len(audio_items) - max_audio_parts)]}
        head = [ChatMessage(role="system", content=instructions)] if instructions else []
        turns: list[ChatMessage] = []
        for item in self.items:
            if item.type == "function_call":
                if item.status != "completed":  # cut off while the thinker wrote it: no call was made
                    continue
                if turns and turns[-1].role == "assistant":  # the reply's text before it, or an earlier call
                    turns[-1].tool_calls = [*(turns[-1].tool_calls or []), item.template_call()]
                else:
                    turns.append(ChatMessage(role="assistant", content="", tool_calls=[item.template_call()]))
            elif item.id in as_text:
                text = " ".join(p.text for p in item.parts if p.text)
                if text:
                    turns.append(ChatMessage(role="user", content=text))
            elif item.role in ("user", "tool") or any(p.text for p in item.parts):  # not an empty, cancelled reply
                message = item.chat_message()
                if message.content or item.role == "tool":  # not a user turn whose audio was dropped, untranscribed
                    turns.append(message)
        return head + turns

    def _user_audio(self) -> list[ConversationItem]:
        """The user items whose audio the thinker can still hear, oldest first."""
        return [i for i in self.items if i.role == "user" and any(p.type == "input_audio" and p.audio for p in i.parts)]
