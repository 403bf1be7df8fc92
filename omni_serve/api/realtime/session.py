"""One ``/v1/realtime`` session: its state (config, conversation, input audio buffer, VAD, the active
response) and the websocket loop that feeds it client events.

A response is an ordinary graph request: the conversation so far becomes the thinker's turns and runs
through the same :class:`~omni_serve.graph.orchestrator.OmniRequest` and the same
:meth:`~omni_serve.api.serving.Serving.outputs` as a chat completion. Cancelling it (``response.cancel``,
barge-in, a disconnect) cancels the task that reads the graph's outputs, which is the cancellation a
chat client's disconnect makes: the orchestrator aborts every stage call it started. No stage knows
about sessions.

Events are handled one at a time in arrival order; only the active response's relay runs beside the
loop, and the two share one send lock (a websocket takes one writer at a time).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omni_serve.api.auth import api_key_matches
from omni_serve.api.hosts import origin_allowed
from omni_serve.api.openai.chat import ChatCompletionRequest
from omni_serve.api.openai.errors import APIError, bad_request
from omni_serve.api.openai.transcriptions import transcription_messages
from omni_serve.api.openai.transcriptions import usage_json as transcription_usage
from omni_serve.api.realtime import events as ev
from omni_serve.api.realtime.conversation import (
    Conversation,
    ConversationItem,
    Part,
    item_from_client,
    new_id,
    pcm16_bytes,
    pcm16_ms,
)
from omni_serve.api.realtime.vad import SpeechDetector
from omni_serve.graph.config import RealtimeConfig
from omni_serve.graph.orchestrator import OmniRequest
from omni_serve.media.encode import b64, encode_audio
from omni_serve.types import FinishReason, MediaPart, Modality, SamplingParams, StageOutput, Usage

logger = logging.getLogger("ray.serve")

BYTES_PER_MS = ev.PCM_RATE * 2 // 1000
# Browsers cannot set headers on a websocket: OpenAI's browser SDK sends the key as a subprotocol.
KEY_PROTOCOL = "openai-insecure-api-key."
POLICY_VIOLATION = 1008  # RFC 6455: the close code for a session that broke a rule (auth, limits)


@dataclass(frozen=True)
class SessionGraph:
    """What a session uses of its ingress: the graph's facts and the one way to run a request."""

    model: str
    outputs: Callable[[OmniRequest, str], AsyncIterator[StageOutput]]  # Serving.outputs
    sampling: Callable[[ChatCompletionRequest], dict[str, SamplingParams]]  # StageSampling.for_chat
    voice: Callable[[str, str], Awaitable[str | None]]  # (name, param) -> the graph's voice, or a 400
    text_stage: str | None
    speaks: bool  # the graph has an audio final output
    takes_audio: bool  # the entry stage takes audio input
    max_audio_parts: int  # media parts one request may carry (media_input.max_parts)
    max_audio_bytes: int
    limits: RealtimeConfig


@dataclass
class Settings:
    """The session's effective configuration (``session.updated`` shows it whole)."""

    instructions: str = ""
    modalities: list[str] = field(default_factory=lambda: ["audio"])
    voice: str | None = None  # as the client named it
    turn: ev.TurnDetection | None = field(default_factory=ev.TurnDetection)
    transcription: ev.Transcription | None = None
    max_output_tokens: int | str = "inf"


@dataclass
class Response:
    id: str
    item: ConversationItem
    modalities: list[str]
    in_conversation: bool
    metadata: dict[str, str] | None = None  # the client's, echoed (LiveKit matches its generate_reply by it)
    task: asyncio.Task[None] | None = None
    cancel_reason: str | None = None
    finishing: bool = False  # its outputs are done: it is sending its closing events (never cancelled then)
    usage: Usage = field(default_factory=Usage)


class Session:
    def __init__(self, graph: SessionGraph, send: Callable[[dict[str, Any]], Awaitable[None]]):
        self.graph = graph
        self.limits = graph.limits
        self._send = send
        self.id = new_id("sess")
        self.settings = Settings(modalities=["audio"] if graph.speaks else ["text"])
        self.conversation = Conversation()
        self.buffer = bytearray()  # uncommitted input audio, pcm16 24 kHz
        self.appended_ms = 0.0  # all audio appended in the session (the VAD's clock)
        if not graph.takes_audio:  # no audio to detect turns in (session.updated says so)
            self.settings.turn = None
        turn = self.settings.turn
        self.detector: SpeechDetector | None = SpeechDetector(turn) if turn else None
        self.speech_item: str | None = None  # the user item the speech in progress will become
        self.speech_start_ms = 0
        self.response: Response | None = None
        self.spoke = False  # the voice is fixed once audio went out (OpenAI's rule)
        self._tokens = 2 * self.limits.events_per_second  # the rate limit's bucket
        self._refilled = time.monotonic()
        self._transcriptions: set[asyncio.Task[None]] = set()
        self._transcribing = asyncio.Semaphore(1)  # one transcription request in the graph per session

    # ---- sending ------------------------------------------------------------------------------
    async def send(self, kind: str, **fields: Any) -> None:
        await self._send(ev.server_event(kind, **fields))

    async def error(self, error: APIError, event_id: str | None) -> None:
        await self._send(ev.error_event(error, event_id))

    def session_json(self) -> dict[str, Any]:
        s = self.settings
        fmt = {"type": "audio/pcm", "rate": ev.PCM_RATE}
        turn = None if s.turn is None else {"type": "server_vad", **s.turn.model_dump(exclude={"type"})}
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.graph.model,
            "instructions": s.instructions,
            "output_modalities": s.modalities,
            "max_output_tokens": s.max_output_tokens,
            "audio": {
                "input": {
                    "format": fmt,
                    "turn_detection": turn,
                    "transcription": s.transcription.model_dump() if s.transcription else None,
                },
                "output": {"format": fmt, "voice": s.voice},
            },
        }

    # ---- the event loop's one entry -------------------------------------------------------------
    async def handle(self, raw: str | bytes) -> None:
        """One client message: parsed, rate-limited, dispatched; what is wrong with it becomes an ``error`` event."""
        event_id: str | None = None
        try:
            if len(raw) > self.limits.max_event_bytes:
                raise APIError(
                    400,
                    f"event of {len(raw)} bytes is over the limit of {self.limits.max_event_bytes} "
                    "(realtime.max_event_bytes)",
                    type="invalid_request_error",
                    code="event_too_large",
                )
            try:
                data = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as err:
                raise APIError(400, f"the event is not valid JSON ({err})", type="invalid_request_error") from None
            event_id = data.get("event_id") if isinstance(data, dict) else None
            event_id = event_id if isinstance(event_id, str) else None
            self._rate_limit()
            await self._dispatch(ev.parse_client_event(data))
        except APIError as err:
            await self.error(err, event_id)

    def _rate_limit(self) -> None:
        now = time.monotonic()
        rate = self.limits.events_per_second
        self._tokens = min(2 * rate, self._tokens + (now - self._refilled) * rate)
        self._refilled = now
        if self._tokens < 1:
            raise APIError(
                429,
                f"more than {rate:g} events per second (realtime.events_per_second): this event was dropped",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            )
        self._tokens -= 1

    async def _dispatch(self, event: ev.ClientEvent) -> None:
        if isinstance(event, ev.SessionUpdate):
            await self._update(event.session)
        elif isinstance(event, ev.BufferAppend):
            if not self.graph.takes_audio:  # its items would fail every later response at the entry stage
                raise bad_request("input_audio_buffer.append: this graph takes no audio input", "audio")
            await self._append(pcm16_bytes(event.audio, "audio", self.graph.max_audio_bytes))
        elif isinstance(event, ev.BufferCommit):
            await self._commit(None)
        elif isinstance(event, ev.BufferClear):
            self._clear_buffer()
            await self.send("input_audio_buffer.cleared")
        elif isinstance(event, ev.ItemCreate):
            self._check_room()
            item = item_from_client(event.item, self.graph.max_audio_bytes, self.graph.takes_audio)
            await self._add_item(item, event.previous_item_id)
        elif isinstance(event, ev.ItemTruncate):
            item = self.conversation.find(event.item_id)
            if item.role != "assistant":
                raise bad_request("item_id: only assistant items can be truncated", "item_id")
            if event.content_index >= len(item.parts):
                raise bad_request(f"content_index: item has {len(item.parts)} content parts", "content_index")
            item.truncate(event.content_index, event.audio_end_ms)
            await self.send(
                "conversation.item.truncated",
                item_id=item.id,
                content_index=event.content_index,
                audio_end_ms=event.audio_end_ms,
            )
        elif isinstance(event, ev.ItemDelete):
            self.conversation.delete(event.item_id)
            await self.send("conversation.item.deleted", item_id=event.item_id)
        elif isinstance(event, ev.ItemRetrieve):
            item = self.conversation.find(event.item_id)
            await self.send("conversation.item.retrieved", item=item.json(with_audio=True))
        elif isinstance(event, ev.ResponseCreate):
            await self._respond(event.response or ev.ResponseParams())
        elif isinstance(event, ev.ResponseCancel):
            active = self.response
            if active is None or (event.response_id is not None and event.response_id != active.id):
                raise bad_request("response_id: no active response to cancel", "response_id")
            await self.cancel("client_cancelled")
        elif isinstance(event, ev.OutputAudioClear):
            pass  # WebRTC/SIP only in OpenAI's API; over a websocket the client owns playback

    # ---- session.update -------------------------------------------------------------------------
    async def _update(self, config: ev.SessionConfig) -> None:
        s = self.settings
        if config.model is not None and config.model != self.graph.model:
            raise bad_request(f"session.model: this server serves '{self.graph.model}'", "session.model")
        modalities = config.output_modalities
        if modalities == ["audio"] and not self.graph.speaks:
            param = "session.output_modalities"
            raise bad_request(f"{param}: this graph does not produce audio", param)
        audio = config.audio or ev.SessionAudio()
        voice = audio.output.voice if audio.output else None
        if voice is not None:
            if self.spoke and voice != s.voice:
                raise bad_request("session.audio.output.voice: the voice cannot change once audio was sent", "voice")
            await self.graph.voice(voice, "session.audio.output.voice")
        turn_set = audio.input is not None and "turn_detection" in audio.input.model_fields_set
        turn_on = turn_set and audio.input is not None and audio.input.turn_detection is not None
        if turn_on and not self.graph.takes_audio:
            raise bad_request("session.audio.input.turn_detection: this graph takes no audio", "turn_detection")
        # Validated whole: now applied.
        if config.instructions is not None:
            s.instructions = config.instructions
        if modalities is not None:
            s.modalities = list(modalities)
        if voice is not None:
            s.voice = voice
        if config.max_output_tokens is not None:
            s.max_output_tokens = config.max_output_tokens
        if audio.input is not None and "transcription" in audio.input.model_fields_set:
            s.transcription = audio.input.transcription
        if turn_set and audio.input is not None:
            s.turn = audio.input.turn_detection
            self.detector = SpeechDetector(s.turn, self.appended_ms) if s.turn is not None else None
            self.speech_item = None
        await self.send("session.updated", session=self.session_json())

    # ---- the input audio buffer -----------------------------------------------------------------
    async def _append(self, pcm: bytes) -> None:
        limit = self.limits.max_buffered_audio_s
        if (len(self.buffer) + len(pcm)) / (BYTES_PER_MS * 1000) > limit:
            raise APIError(
                400,
                f"audio: the input audio buffer would hold more than {limit:g} s (realtime.max_buffered_audio_s); "
                "commit or clear it",
                type="invalid_request_error",
                param="audio",
                code="input_audio_buffer_full",
            )
        self.buffer += pcm
        self.appended_ms += len(pcm) / BYTES_PER_MS
        if self.detector is None or self.settings.turn is None:
            return
        for edge in self.detector.feed(pcm):
            if edge.started:
                await self._speech_started(edge.at_ms)
            else:
                await self._speech_stopped(edge.at_ms)
        if not self.detector.speaking:  # keep only what a turn starting now would include
            keep = self.settings.turn.prefix_padding_ms * BYTES_PER_MS
            del self.buffer[: max(0, len(self.buffer) - keep)]

    def _buffer_start_ms(self) -> float:
        return self.appended_ms - len(self.buffer) / BYTES_PER_MS

    def _clear_buffer(self) -> None:
        self.buffer.clear()
        self.speech_item = None
        if self.detector is not None:
            self.detector.reset()

    async def _speech_started(self, at_ms: int) -> None:
        turn = self.settings.turn
        assert turn is not None
        self.speech_start_ms = max(int(self._buffer_start_ms()), at_ms - turn.prefix_padding_ms)
        self.speech_item = new_id("item")
        await self.send(
            "input_audio_buffer.speech_started", audio_start_ms=self.speech_start_ms, item_id=self.speech_item
        )
        if turn.interrupt_response and self.response is not None:
            await self.cancel("turn_detected")  # barge-in

    async def _speech_stopped(self, at_ms: int) -> None:
        turn = self.settings.turn
        assert turn is not None
        item_id = self.speech_item or new_id("item")
        await self.send("input_audio_buffer.speech_stopped", audio_end_ms=at_ms, item_id=item_id)
        start = max(0, round((self.speech_start_ms - self._buffer_start_ms()) * BYTES_PER_MS) // 2 * 2)
        end = max(start, round((at_ms - self._buffer_start_ms()) * BYTES_PER_MS) // 2 * 2)
        speech = bytes(self.buffer[start:end])
        del self.buffer[:end]
        self.speech_item = None
        if not speech:  # nothing of it left in the buffer (cleared or committed while speaking)
            return
        if await self._commit(speech, item_id) and turn.create_response and self.response is None:
            await self._respond(ev.ResponseParams())

    async def _commit(self, audio: bytes | None, item_id: str | None = None) -> bool:
        """The buffer (or ``audio``, a VAD turn) as a user item; False when it could not be added."""
        if audio is None:
            audio = bytes(self.buffer)
            self._clear_buffer()
            if pcm16_ms(audio) < 100:  # OpenAI's rule: at least 100 ms to commit
                raise bad_request("input_audio_buffer: less than 100 ms of audio to commit", "input_audio_buffer")
        item = ConversationItem(item_id or new_id("item"), "user", [Part("input_audio", "", audio)])
        try:
            self._check_room()
        except APIError as err:
            await self.error(err, None)
            return False
        previous = self.conversation.items[-1].id if self.conversation.items else None
        await self.send("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id)
        await self._add_item(item, None)
        if self.settings.transcription is not None:
            task = asyncio.create_task(self._transcribe(item, self.settings.transcription))
            self._transcriptions.add(task)
            task.add_done_callback(self._transcriptions.discard)
        return True

    async def _transcribe(self, item: ConversationItem, options: ev.Transcription) -> None:
        """``input_audio_transcription``: the transcription route's request, run beside the conversation
        (one at a time: a session that commits faster than the thinker transcribes queues here, not in the graph)."""
        async with self._transcribing:
            await self._transcribe_now(item, options)

    async def _transcribe_now(self, item: ConversationItem, options: ev.Transcription) -> None:
        (audio,) = [p for p in item.chat_message().content if isinstance(p, MediaPart)]
        request = OmniRequest(
            request_id=uuid.uuid4().hex,
            modalities={Modality.TEXT},
            sampling=self.graph.sampling(ChatCompletionRequest.model_construct(messages=[])),
            messages=transcription_messages(audio, options.language, options.prompt),
        )
        where = {"item_id": item.id, "content_index": 0}
        transcript, usage = "", Usage()
        outputs = self.graph.outputs(request, "transcriptions")
        try:
            async for output in outputs:
                if output.text:
                    transcript += output.text
                    await self.send("conversation.item.input_audio_transcription.delta", **where, delta=output.text)
                if output.stage == self.graph.text_stage and output.usage:
                    usage = output.usage
        except APIError as err:
            error = err.body()["error"]
            await self.send("conversation.item.input_audio_transcription.failed", **where, error=error)
            return
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        item.parts[0].text = transcript
        await self.send(
            "conversation.item.input_audio_transcription.completed",
            **where,
            transcript=transcript,
            usage=transcription_usage(usage),
        )

    def _check_room(self) -> None:
        if len(self.conversation.items) >= self.limits.max_items:
            raise APIError(
                400,
                f"the conversation holds {self.limits.max_items} items (realtime.max_items): delete some first",
                type="invalid_request_error",
                code="conversation_full",
            )

    async def _add_item(self, item: ConversationItem, previous_item_id: str | None) -> None:
        previous = self.conversation.add(item, previous_item_id)
        await self.send("conversation.item.added", previous_item_id=previous, item=item.json())
        await self.send("conversation.item.done", previous_item_id=previous, item=item.json())

    # ---- responses ------------------------------------------------------------------------------
    async def _respond(self, params: ev.ResponseParams) -> None:
        if self.response is not None:
            raise APIError(
                400,
                f"conversation already has an active response ({self.response.id}): cancel it or wait for "
                "response.done",
                type="invalid_request_error",
                code="conversation_already_has_active_response",
            )
        s = self.settings
        modalities = list(params.output_modalities or s.modalities)
        if modalities == ["audio"] and not self.graph.speaks:
            raise bad_request("response.output_modalities: this graph does not produce audio", "output_modalities")
        override = params.audio.output if params.audio else None
        named = override.voice if override and override.voice else s.voice
        voice = await self.graph.voice(named, "response.audio.output.voice") if named else None
        in_conversation = params.conversation == "auto"
        if in_conversation:
            self._check_room()
        limit = params.max_output_tokens or s.max_output_tokens
        # The chat route's resolution (defaults, overrides, what each engine honours), fed the fields it reads.
        sampled = ChatCompletionRequest.model_construct(
            messages=[],
            seed=params.seed,
            stage_sampling=params.stage_sampling,
            max_completion_tokens=limit if isinstance(limit, int) else None,
        )
        sampling = self.graph.sampling(sampled)
        instructions = params.instructions if params.instructions is not None else s.instructions
        request = OmniRequest(
            request_id=uuid.uuid4().hex,
            modalities={Modality.AUDIO} if modalities == ["audio"] else {Modality.TEXT},
            sampling=sampling,
            messages=self.conversation.chat_messages(instructions, self.graph.max_audio_parts),
            voice=voice,
        )
        kind = "output_audio" if modalities == ["audio"] else "output_text"
        item = ConversationItem(new_id("item"), "assistant", [Part(kind)], status="in_progress")
        response = Response(f"resp_{request.request_id[:20]}", item, modalities, in_conversation, params.metadata)
        self.response = response
        await self.send("response.created", response=self._response_json(response, "in_progress"))
        response.task = asyncio.create_task(self._relay(response, request))

    async def _relay(self, response: Response, request: OmniRequest) -> None:
        """Stream one response's outputs as events; always ends with ``response.done``."""
        item, part = response.item, response.item.parts[0]
        audio = part.type == "output_audio"
        where = {"response_id": response.id, "item_id": item.id, "output_index": 0, "content_index": 0}
        status, details = "completed", None
        outputs = self.graph.outputs(request, "realtime")
        try:
            previous = self.conversation.add(item) if response.in_conversation else None
            await self.send("response.output_item.added", response_id=response.id, output_index=0, item=item.json())
            if response.in_conversation:
                await self.send("conversation.item.added", previous_item_id=previous, item=item.json())
            await self.send(
                "response.content_part.added", **where, part={"type": "audio" if audio else "text", "transcript": ""}
            )
            async for output in outputs:
                if output.text:
                    part.text += output.text
                    kind = "response.output_audio_transcript.delta" if audio else "response.output_text.delta"
                    await self.send(kind, **where, delta=output.text)
                if output.audio is not None and audio:
                    if output.sample_rate != ev.PCM_RATE:
                        raise APIError(
                            500, f"the graph's audio is {output.sample_rate} Hz, not 24000", type="server_error"
                        )
                    pcm = encode_audio(output.audio, ev.PCM_RATE, "pcm")
                    part.audio += pcm
                    self.spoke = True
                    await self.send("response.output_audio.delta", **where, delta=b64(pcm))
                if output.stage == self.graph.text_stage and output.usage:
                    response.usage = output.usage
                if output.stage == self.graph.text_stage and output.finish_reason is FinishReason.LENGTH:
                    status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            # response.cancel, barge-in or the session's end: the orchestrator's stage calls were cancelled
            # with the outputs' reader (this task); what was sent is what the item keeps.
            status, details = "cancelled", {"type": "cancelled", "reason": response.cancel_reason or "client_cancelled"}
        except APIError as err:
            status, details = "failed", {"type": "failed", "error": err.body()["error"]}
        except Exception as err:  # a stage's or the socket's failure: the response still ends with response.done
            error = APIError(500, f"the response failed ({type(err).__name__})", type="server_error").body()["error"]
            status, details = "failed", {"type": "failed", "error": error}
        finally:
            response.finishing = True  # from here cancel() waits for response.done instead of cutting it off
            await outputs.aclose()  # type: ignore[attr-defined]
        item.status = "completed" if status == "completed" else "incomplete"
        try:
            await self._finish(response, status, details, where)
        finally:
            self.response = None

    async def _finish(self, response: Response, status: str, details: Any, where: dict[str, Any]) -> None:
        item, part = response.item, response.item.parts[0]
        if part.type == "output_audio":
            await self.send("response.output_audio.done", **where)
            await self.send("response.output_audio_transcript.done", **where, transcript=part.text)
        else:
            await self.send("response.output_text.done", **where, text=part.text)
        kind = "audio" if part.type == "output_audio" else "text"
        await self.send("response.content_part.done", **where, part={"type": kind, "transcript": part.text})
        await self.send("response.output_item.done", response_id=response.id, output_index=0, item=item.json())
        if response.in_conversation:
            await self.send("conversation.item.done", item=item.json())
        await self.send("response.done", response=self._response_json(response, status, details))

    def _response_json(self, response: Response, status: str, details: Any = None) -> dict[str, Any]:
        u = response.usage
        return {
            "id": response.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [response.item.json()] if status != "in_progress" else [],
            "output_modalities": response.modalities,
            "conversation_id": self.id if response.in_conversation else None,
            "metadata": response.metadata,
            "usage": {
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "input_tokens": u.prompt_tokens,
                "output_tokens": u.completion_tokens,
                "input_token_details": {"text_tokens": u.prompt_tokens, "audio_tokens": 0, "cached_tokens": 0},
                "output_token_details": {"text_tokens": u.completion_tokens, "audio_tokens": 0},
            },
        }

    async def cancel(self, reason: str) -> None:
        """Cancel the active response and wait until its ``response.done`` went out."""
        response = self.response
        if response is None or response.task is None:
            return
        response.cancel_reason = reason
        if not response.finishing:
            response.task.cancel()
        await asyncio.gather(response.task, return_exceptions=True)
        if self.response is response:  # cancelled before its relay ran: it sent only response.created
            self.response = None
            details = {"type": "cancelled", "reason": reason}
            await self.send("response.done", response=self._response_json(response, "cancelled", details))

    async def close(self) -> None:
        await self.cancel("client_cancelled")
        for task in list(self._transcriptions):
            task.cancel()
        await asyncio.gather(*self._transcriptions, return_exceptions=True)


# ---- the websocket ------------------------------------------------------------------------------


def _refusal(websocket: WebSocket, graph: SessionGraph, api_key: str | None) -> APIError | None:
    """Why this connection may not open a session (auth, Origin, model), or None."""
    protocols = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    if api_key is not None:
        offered = [p[len(KEY_PROTOCOL) :] for p in protocols if p.startswith(KEY_PROTOCOL)]
        header = websocket.headers.get("authorization")
        if not api_key_matches(header, api_key) and not any(api_key_matches(f"Bearer {k}", api_key) for k in offered):
            return APIError(
                401,
                f"missing or invalid API key (Authorization: Bearer ..., or the subprotocol {KEY_PROTOCOL}<key>)",
                type="authentication_error",
                code="invalid_api_key",
            )
    origin = websocket.headers.get("origin")
    if origin is not None and not origin_allowed(origin, websocket.headers.get("host"), graph.limits.allowed_origins):
        message = f"origin {origin[:80]!r} is neither this server's nor listed in realtime.allowed_origins"
        return APIError(403, message, type="invalid_request_error", code="origin_not_allowed")
    model = websocket.query_params.get("model")
    if model is not None and model != graph.model:
        return APIError(
            404,
            f"model '{model}' does not exist; this server serves '{graph.model}'",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )
    return None


async def serve_session(
    websocket: WebSocket, graph: SessionGraph, api_key: str | None, serve_limit_s: float | None
) -> None:
    """Run one session on ``websocket`` until the client leaves or a limit ends it.

    ``serve_limit_s``: Serve's proxy applies ``http_options.request_timeout_s`` to a websocket's whole
    life (Ray 2.60, ``ProxyResponseGenerator``'s ``timeout_s``) and then drops it without a close frame;
    the session ends itself before that, with its error event and close code.
    """
    protocols = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",")]
    await websocket.accept(subprotocol="realtime" if "realtime" in protocols else None)
    lock = asyncio.Lock()

    async def send(event: dict[str, Any]) -> None:
        async with lock:
            if websocket.application_state == WebSocketState.CONNECTED:
                await websocket.send_text(json.dumps(event, separators=(",", ":")))

    refusal = _refusal(websocket, graph, api_key)
    if refusal is not None:  # accepted first, so the client reads why in an error event, then the close
        await send(ev.error_event(refusal, None))
        await websocket.close(POLICY_VIOLATION, refusal.message[:120])
        return
    session = Session(graph, send)
    await session.send("session.created", session=session.session_json())
    limit_s = graph.limits.max_session_minutes * 60
    if serve_limit_s is not None and serve_limit_s < limit_s:
        limit_s, limit_name = serve_limit_s, "Serve's http_options.request_timeout_s, less a margin"
    else:
        limit_name = "realtime.max_session_minutes"
    ends = time.monotonic() + limit_s
    try:
        while True:
            try:
                message = await asyncio.wait_for(websocket.receive(), max(0.0, ends - time.monotonic()))
            except asyncio.TimeoutError:  # not the builtin before Python 3.11
                expired = APIError(
                    400,
                    f"the session reached its maximum duration of {limit_s:.0f} s ({limit_name})",
                    type="invalid_request_error",
                    code="session_expired",
                )
                await session.close()
                await session.error(expired, None)
                await websocket.close(POLICY_VIOLATION, "session_expired")
                return
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            await session.handle(raw if raw is not None else message.get("bytes") or b"")
    except WebSocketDisconnect:
        return
    finally:
        await session.close()
