"""One ``/v1/realtime`` session: its settings and state, and the client events that change them.

The session's parts, each in the module named after it: its settings and ``session.update``
(:mod:`.settings`), the input audio buffer and its turns (:mod:`.input_audio`, the VAD in :mod:`.vad`),
the conversation (:mod:`.conversation`), responses (:mod:`.responses`), ``input_audio_transcription``
(:mod:`.transcription`), what it uses of its ingress (:mod:`.session_graph`); the websocket that feeds
it (:mod:`.connection`) and who may open one (:mod:`.admission`). Each part names what it uses of the
session (a Protocol), so none imports this module. This module parses each client event, holds the
session to its budgets (events and bytes per second, :mod:`.budget`; the bytes it holds) and
dispatches it. No stage knows about sessions.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from omni_serve.api.openai.errors import APIError, bad_request
from omni_serve.api.realtime import events as ev
from omni_serve.api.realtime.budget import TokenBucket
from omni_serve.api.realtime.conversation import (
    Conversation,
    ConversationItem,
    Part,
    item_from_client,
    new_id,
    pcm16_bytes,
    pcm16_ms,
)
from omni_serve.api.realtime.input_audio import InputAudio
from omni_serve.api.realtime.responses import Responses
from omni_serve.api.realtime.session_graph import SessionGraph
from omni_serve.api.realtime.settings import Settings, update
from omni_serve.api.realtime.transcription import Transcriptions

# Queues one server event (the connection's outbox): a dict, or the JSON text of one already serialized.
Send = Callable[[dict[str, Any] | str], None]


class Session:
    def __init__(self, graph: SessionGraph, send: Send):
        self.graph = graph
        self.limits = graph.limits
        self.send_event = send
        self.id = new_id("sess")
        self.settings = Settings(modalities=["audio"] if graph.speaks else ["text"])
        if not graph.takes_audio:  # no audio to detect turns in (session.updated says so)
            self.settings = dataclasses.replace(self.settings, turn=None)
        # The settings as session.updated carries them, serialized once per change (an echo costs no CPU).
        self._settings_text = self._serialized(self.settings)
        self._room = 0  # what grow() may add before the held bytes are counted again (none yet: count first)
        self._heard = time.monotonic()  # the client's last event (idle_timeout_s)
        self.conversation = Conversation()
        self.audio = InputAudio(self.limits, graph.vad, self.settings.turn)
        self.responses = Responses(self)
        self.transcriptions = Transcriptions(self)
        self.spoke = False  # the voice is fixed once audio went out (OpenAI's rule)
        self._events = TokenBucket(self.limits.events_per_second, 2 * self.limits.events_per_second)
        self._bytes = TokenBucket(self.limits.bytes_per_second, self.limits.max_session_bytes)
        # session.updated resends what the client already has: at most one largest settings a second (bursts
        # of two). bytes_per_second alone let 41-byte empty updates pull 8 MiB/s of echoes through the ingress.
        config = self.limits.max_session_config_bytes
        self._echoes = TokenBucket(config, 2 * config)

    # ---- sending ------------------------------------------------------------------------------
    def send(self, kind: str, **fields: Any) -> None:
        self.send_event(ev.server_event(kind, **fields))

    def error(self, error: APIError, event_id: str | None) -> None:
        self.send_event(ev.error_event(error, event_id))

    def session_json(self) -> dict[str, Any]:
        return self.settings.json(self.id, self.graph.model)

    def send_session(self, kind: str) -> None:
        """``session.created`` or ``.updated``: the settings' serialized text, not serialized again."""
        self.send_event(ev.server_event_text(kind, "session", self._settings_text))

    def _serialized(self, settings: Settings) -> str:
        return json.dumps(settings.json(self.id, self.graph.model), separators=(",", ":"))

    # ---- budgets: what the session spends per second and what it holds -------------------------
    def spend_bytes(self, n: int) -> None:
        """Move ``n`` more bytes now (an event received, the audio a response carries), or refuse."""
        if not self._bytes.take(n):
            raise APIError(
                429,
                f"this session moves more than {self.limits.bytes_per_second:.0f} bytes per second "
                "(realtime.bytes_per_second): this was dropped",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            )

    def held_bytes(self) -> int:
        """What the session holds: its input audio buffer, its items' audio and text, its settings (instructions,
        tools, ...: counted as their serialized text, which the session keeps for its echoes)."""
        return len(self.audio.buffer) + self.conversation.nbytes() + len(self._settings_text)

    def idle_since(self) -> float | None:
        """Since when (``time.monotonic``) neither the client sent an event nor a response ran; None while one runs."""
        if self.responses.active is not None:
            return None
        return max(self._heard, self.responses.ended)

    def pending_transcriptions(self) -> int:
        return len(self.transcriptions.tasks)

    def make_room(self, n: int) -> None:
        """Room for ``n`` more bytes: the audio the thinker no longer reads dropped first, else refused."""
        held = self.held_bytes()
        over = held + n - self.limits.max_session_bytes
        freed = self.conversation.drop_unread_audio(over, self.graph.max_audio_parts) if over > 0 else 0
        if over > freed:
            raise APIError(
                400,
                f"the session would hold more than {self.limits.max_session_bytes} bytes "
                "(realtime.max_session_bytes): delete items or clear the input audio buffer",
                type="invalid_request_error",
                code="session_memory_full",
            )
        self._room = self.limits.max_session_bytes - (held - freed + n)

    def fit(self) -> None:
        """After the server added to the conversation (a reply's audio, a transcript): back within the bytes."""
        held = self.held_bytes()
        over = held - self.limits.max_session_bytes
        freed = self.conversation.drop_unread_audio(over, self.graph.max_audio_parts) if over > 0 else 0
        self._room = self.limits.max_session_bytes - (held - freed)

    def grow(self, n: int) -> None:
        """The server added ``n`` bytes (a reply's audio chunk): spent from the room counted last, and counted
        again (:meth:`fit`) only once that is spent, not over every item per chunk. Whatever else adds bytes
        counts them first (:meth:`make_room`, :meth:`fit`), which counts the room again."""
        self._room -= n
        if self._room < 0:
            self.fit()

    def check_room(self) -> None:
        if len(self.conversation.items) >= self.limits.max_items:
            raise APIError(
                400,
                f"the conversation holds {self.limits.max_items} items (realtime.max_items): delete some first",
                type="invalid_request_error",
                code="conversation_full",
            )

    # ---- the event loop's one entry -------------------------------------------------------------
    async def handle(self, raw: str | bytes) -> None:
        """One client message: rate-limited, parsed, dispatched; what is wrong with it becomes an ``error`` event."""
        event_id: str | None = None
        self._heard = time.monotonic()
        try:
            if len(raw) > self.limits.max_event_bytes:
                raise APIError(
                    400,
                    f"event of {len(raw)} bytes is over the limit of {self.limits.max_event_bytes} "
                    "(realtime.max_event_bytes)",
                    type="invalid_request_error",
                    code="event_too_large",
                )
            self._rate_limit(len(raw))
            try:
                data = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError) as err:  # RecursionError: nested too deep
                raise APIError(400, f"the event is not valid JSON ({err})", type="invalid_request_error") from None
            event_id = data.get("event_id") if isinstance(data, dict) else None
            event_id = event_id if isinstance(event_id, str) else None
            await self._dispatch(ev.parse_client_event(data), event_id)
        except APIError as err:
            self.error(err, event_id)

    def _rate_limit(self, size: int) -> None:
        """Before the event is parsed: parsing and decoding cost CPU per byte, the events' handling per event."""
        rate = self.limits.events_per_second
        if not self._events.take(1):
            raise APIError(
                429,
                f"more than {rate:g} events per second (realtime.events_per_second): this event was dropped",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            )
        self.spend_bytes(size)

    async def _dispatch(self, event: ev.ClientEvent, event_id: str | None) -> None:
        if isinstance(event, ev.SessionUpdate):
            self._apply(await update(self, event.session))
            self.send_session("session.updated")
        elif isinstance(event, ev.BufferAppend):
            if not self.graph.takes_audio:  # its items would fail every later response at the entry stage
                raise bad_request("input_audio_buffer.append: this graph takes no audio input", "audio")
            await self._append(pcm16_bytes(event.audio, "audio", self.graph.max_audio_bytes), event_id)
        elif isinstance(event, ev.BufferCommit):
            audio = self.audio.take()
            if pcm16_ms(audio) < 100:  # OpenAI's rule: at least 100 ms to commit
                raise bad_request("input_audio_buffer: less than 100 ms of audio to commit", "input_audio_buffer")
            self._commit(new_id("item"), audio, event_id)
        elif isinstance(event, ev.BufferClear):
            self.audio.clear()
            self.send("input_audio_buffer.cleared")
        elif isinstance(event, ev.ItemCreate):
            self.check_room()
            item = item_from_client(event.item, self.graph.max_audio_bytes, self.graph.takes_audio)
            self.make_room(item.nbytes())
            self._add_item(item, event.previous_item_id)
        elif isinstance(event, ev.ItemTruncate):
            item = self.conversation.find(event.item_id)
            if item.role != "assistant" or item.type != "message":
                raise bad_request("item_id: only assistant messages can be truncated", "item_id")
            if event.content_index >= len(item.parts):
                raise bad_request(f"content_index: item has {len(item.parts)} content parts", "content_index")
            item.truncate(event.content_index, event.audio_end_ms)
            self.send(
                "conversation.item.truncated",
                item_id=item.id,
                content_index=event.content_index,
                audio_end_ms=event.audio_end_ms,
            )
        elif isinstance(event, ev.ItemDelete):
            self.conversation.delete(event.item_id)
            self.send("conversation.item.deleted", item_id=event.item_id)
        elif isinstance(event, ev.ItemRetrieve):
            item = self.conversation.find(event.item_id)
            self.spend_bytes(item.nbytes())  # its audio (base64-encoded) and text go out again
            self.send("conversation.item.retrieved", item=item.json(with_audio=True))
        elif isinstance(event, ev.ResponseCreate):
            await self.responses.create(event.response or ev.ResponseParams())
        elif isinstance(event, ev.ResponseCancel):
            active = self.responses.active
            if active is None or (event.response_id is not None and event.response_id != active.id):
                raise bad_request("response_id: no active response to cancel", "response_id")
            await self.responses.cancel("client_cancelled")
        elif isinstance(event, ev.OutputAudioClear):
            pass  # WebRTC/SIP only in OpenAI's API; over a websocket the client owns playback

    def _apply(self, settings: Settings) -> None:
        """Hold the settings an update made, if their bytes allow: they stay within ``max_session_config_bytes``,
        are bytes the session holds, and their echo (``session.updated`` carries them whole, however little the
        update changed) is bytes the session moves: a 41-byte update costs its echo's bytes of the budget, and of
        the echoes' own (``max_session_config_bytes`` a second)."""
        text = self._settings_text if settings is self.settings else self._serialized(settings)
        limit = self.limits.max_session_config_bytes
        if len(text) > limit:
            raise APIError(
                400,
                f"session: the settings would be {len(text)} bytes as session.updated carries them, over "
                f"{limit} (realtime.max_session_config_bytes): send fewer or shorter tools or instructions",
                type="invalid_request_error",
                param="session",
                code="session_config_too_large",
            )
        if not self._echoes.take(len(text)):
            raise APIError(
                429,
                f"this session's session.updated echoes would pass {limit} bytes per second "
                "(realtime.max_session_config_bytes): this update was dropped",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            )
        self.spend_bytes(len(text))
        self.make_room(len(text) - len(self._settings_text))
        if settings.turn is not self.settings.turn:
            self.audio.set_turn(settings.turn)
        self.settings, self._settings_text = settings, text

    # ---- input audio and turns ------------------------------------------------------------------
    async def _append(self, pcm: bytes, event_id: str | None) -> None:
        self.make_room(len(pcm))
        for edge in await self.audio.append(pcm):
            turn = self.settings.turn
            assert turn is not None
            if edge.started:
                self.send("input_audio_buffer.speech_started", **self.audio.speech_started(edge.at_ms))
                if turn.interrupt_response and self.responses.active is not None:
                    await self.responses.cancel("turn_detected")  # barge-in
                continue
            item_id, speech = self.audio.speech_stopped(edge.at_ms)
            self.send("input_audio_buffer.speech_stopped", audio_end_ms=edge.at_ms, item_id=item_id)
            if not speech:  # nothing of it left in the buffer (cleared or committed while speaking)
                continue
            try:
                self._commit(item_id, speech, event_id)
            except APIError as err:  # the turn is lost; the session goes on
                self.error(err, event_id)
                continue
            if turn.create_response and self.responses.active is None:
                try:
                    await self.responses.create(ev.ResponseParams())
                except APIError as err:  # e.g. the session's budgets: the turn stays, unanswered
                    self.error(err, event_id)
        self.audio.trim()

    def _commit(self, item_id: str, audio: bytes, event_id: str | None) -> None:
        """A turn's audio as a user item (transcribed if the session asks for it)."""
        self.check_room()
        item = ConversationItem(item_id, "user", [Part("input_audio", "", audio)])
        previous = self.conversation.items[-1].id if self.conversation.items else None
        self.send("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id)
        self._add_item(item, None)
        if self.settings.transcription is not None:
            self.transcriptions.start(item, self.settings.transcription, event_id)

    def _add_item(self, item: ConversationItem, previous_item_id: str | None) -> None:
        previous = self.conversation.add(item, previous_item_id)
        self.send("conversation.item.added", previous_item_id=previous, item=item.json())
        self.send("conversation.item.done", previous_item_id=previous, item=item.json())

    async def close(self) -> None:
        await self.responses.cancel("client_cancelled")
        await self.transcriptions.close()
        self.audio.close()
