"""A session's responses: ``response.create`` -> a graph request over the conversation -> events, until
``response.done``.

A response is an ordinary graph request: the conversation so far becomes the thinker's turns and runs
through the same :class:`~omni_serve.graph.request.OmniRequest`, the same sampling resolution
(validated as a chat completion's: one set of bounds) and the same
:meth:`~omni_serve.api.serving.Serving.outputs` as a chat completion. Cancelling it
(``response.cancel``, barge-in, the session's end) cancels the task that reads the graph's outputs,
which is the cancellation a chat client's disconnect makes: the orchestrator aborts every stage call
it started. A session runs one response at a time.

With tools (the session's or the response's), the entry stage parses its own tool calls, as for a chat
completion (:mod:`omni_serve.models.tool_calls`): each call is a ``function_call`` output item whose
arguments stream as ``response.function_call_arguments.delta``. The talker never hears a call, so a
response that only calls a tool has no message item and sends no audio; one with text and a call speaks
the text alone. The message item is then added when its first text or audio comes (a response that
offers no tools adds it at once, as before).

``response.done`` says how it ended: ``completed``; ``incomplete`` with reason ``max_output_tokens``
when any stage stopped at its ``max_tokens`` (the thinker's reply, or the talker's speech, cut
short); ``cancelled`` with the reason; ``failed`` with the error.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from omni_serve.api.openai.errors import APIError, bad_request, from_validation, renamed
from omni_serve.api.openai.sampling import SamplingRequest
from omni_serve.api.realtime import events as ev
from omni_serve.api.realtime.conversation import Conversation, ConversationItem, Part, new_id
from omni_serve.api.realtime.session_graph import SessionGraph
from omni_serve.api.realtime.settings import Settings
from omni_serve.api.realtime.tools import tool_calling
from omni_serve.graph.request import OmniRequest
from omni_serve.media.encode import AudioEncoder, b64
from omni_serve.types import Modality, SamplingParams, ToolCallDelta, ToolCalling, Usage


class Session(Protocol):
    """What a response uses of its session (:class:`~omni_serve.api.realtime.session.Session`)."""

    id: str
    graph: SessionGraph
    settings: Settings
    conversation: Conversation
    spoke: bool

    def send(self, kind: str, **fields: Any) -> None: ...

    def spend_bytes(self, n: int) -> None: ...

    def check_room(self) -> None: ...

    def grow(self, n: int) -> None: ...


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
    tools: ToolCalling | None = None
    outputs: list[ConversationItem] = field(default_factory=list)  # its output items, in output_index order
    calls: dict[int, ConversationItem] = field(default_factory=dict)  # its function calls by the parser's index

    def index(self, item: ConversationItem) -> int:
        return self.outputs.index(item)


def sampling_of(session: Session, params: ev.ResponseParams, limit: int | str) -> dict[str, SamplingParams]:
    """The response's per-stage sampling, validated and resolved exactly as a chat completion's
    (``response.`` names the field in an error)."""
    fields: dict[str, Any] = {"seed": params.seed, "stage_sampling": params.stage_sampling}
    if isinstance(limit, int):
        fields["max_completion_tokens"] = limit
    try:
        return session.graph.sampling(SamplingRequest.model_validate(fields))
    except ValidationError as err:
        raise renamed(error := from_validation(err), f"response.{error.param}") from None
    except APIError as err:
        raise renamed(err, f"response.{err.param}") from None


class Responses:
    """The session's active response, if any: creating, relaying, cancelling it."""

    def __init__(self, session: Session):
        self.session = session
        self.active: Response | None = None
        self.ended = time.monotonic()  # when the last response ended (the session's idle clock)

    async def create(self, params: ev.ResponseParams) -> None:
        s, graph = self.session.settings, self.session.graph
        if self.active is not None:
            raise APIError(
                400,
                f"conversation already has an active response ({self.active.id}): cancel it or wait for response.done",
                type="invalid_request_error",
                code="conversation_already_has_active_response",
            )
        modalities = list(params.output_modalities or s.modalities)
        if modalities == ["audio"] and not graph.speaks:
            raise bad_request("response.output_modalities: this graph does not produce audio", "output_modalities")
        override = params.audio.output if params.audio else None
        named = override.voice if override and override.voice else s.voice
        voice = await graph.voice(named, "response.audio.output.voice") if named else None
        in_conversation = params.conversation == "auto"
        if in_conversation:
            self.session.check_room()
        sampling = sampling_of(self.session, params, params.max_output_tokens or s.max_output_tokens)
        tools = tool_calling(
            s.tools if params.tools is None else params.tools,
            params.tool_choice if "tool_choice" in params.model_fields_set else s.tool_choice,
            s.parallel_tool_calls if params.parallel_tool_calls is None else params.parallel_tool_calls,
            "response.",
        )
        instructions = params.instructions if params.instructions is not None else s.instructions
        messages = self.session.conversation.chat_messages(instructions, graph.max_audio_parts)
        # The user audio it carries goes into the object store again for each response: bytes the session moves.
        self.session.spend_bytes(sum(len(p.data or b"") for m in messages for p in m.media()))
        request = OmniRequest(
            request_id=uuid.uuid4().hex,
            modalities={Modality.AUDIO} if modalities == ["audio"] else {Modality.TEXT},
            sampling=sampling,
            messages=messages,
            voice=voice,
            stage_log=graph.stage_log(),
            tools=tools,
        )
        kind = "output_audio" if modalities == ["audio"] else "output_text"
        item = ConversationItem(new_id("item"), "assistant", [Part(kind)], status="in_progress")
        response = Response(
            f"resp_{request.request_id[:20]}", item, modalities, in_conversation, params.metadata, tools=tools
        )
        self.active = response
        self.session.send("response.created", response=self.response_json(response, "in_progress"))
        response.task = asyncio.create_task(self._relay(response, request))

    async def _relay(self, response: Response, request: OmniRequest) -> None:
        """Stream one response's outputs as events; always ends with ``response.done``."""
        session, graph = self.session, self.session.graph
        item, part = response.item, response.item.parts[0]
        audio = part.type == "output_audio"
        status, details = "completed", None
        outputs = graph.outputs(request, "realtime")
        # The session's audio is 24 kHz PCM whatever rate the graph speaks at: one encoder a response, so a
        # resampled reply is one continuous signal (its last samples come out of the resampler at the end).
        encoder: AudioEncoder | None = None
        try:
            if response.tools is None:
                self._add_output(response, item)
            async for output in outputs:
                said = output.text or (output.audio is not None and audio)
                if said and item not in response.outputs:
                    self._add_output(response, item)
                where = self._where(response, item)
                if output.text:
                    part.text += output.text
                    if response.in_conversation:
                        session.grow(len(output.text))
                    kind = "response.output_audio_transcript.delta" if audio else "response.output_text.delta"
                    session.send(kind, **where, delta=output.text)
                if output.audio is not None and audio:
                    assert output.sample_rate, "an audio output carries its sample rate"
                    encoder = encoder or AudioEncoder("pcm", output.sample_rate, rate=ev.PCM_RATE)
                    self._say(response, part, where, encoder.encode(output.audio))
                if output.stage == graph.text_stage:
                    for piece in output.tool_calls:
                        self._call_piece(response, piece)
                    if output.usage:
                        response.usage = output.usage
            if encoder is not None:
                self._say(response, part, self._where(response, item), encoder.finish())
            if request.stage_log is not None and request.stage_log.cut_short():
                # A stage stopped at its max_tokens (the thinker's reply, or the talker's speech, cut short).
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            # response.cancel, barge-in or the session's end: the orchestrator's stage calls were cancelled
            # with the outputs' reader (this task); what was sent is what the item keeps.
            status, details = "cancelled", {"type": "cancelled", "reason": response.cancel_reason or "client_cancelled"}
        except APIError as err:
            status, details = "failed", {"type": "failed", "error": err.body()["error"]}
        except Exception as err:  # a stage's failure: the response still ends with response.done
            error = APIError(500, f"the response failed ({type(err).__name__})", type="server_error").body()["error"]
            status, details = "failed", {"type": "failed", "error": error}
        finally:
            response.finishing = True  # from here cancel() waits for response.done instead of cutting it off
            await outputs.aclose()  # type: ignore[attr-defined]
        try:
            if not response.outputs:  # nothing said and nothing called: the (empty) message, as without tools
                self._add_output(response, item)
            for output_item in response.outputs:
                output_item.status = "completed" if status == "completed" else "incomplete"
            self._finish(response, status, details)
        finally:
            self.active, self.ended = None, time.monotonic()

    def _say(self, response: Response, part: Part, where: dict[str, Any], pcm: bytes) -> None:
        """One ``response.output_audio.delta`` (none for no bytes: a resampler may hold a chunk's last samples)."""
        if not pcm:
            return
        self.session.spoke = True
        self.session.send("response.output_audio.delta", **where, delta=b64(pcm))
        if response.in_conversation:  # kept for conversation.item.retrieve / .truncate
            part.add_audio(pcm)
            self.session.grow(len(pcm))

    def _add_output(self, response: Response, item: ConversationItem) -> None:
        """An output item of the response (and the conversation's, unless the response is out of it)."""
        response.outputs.append(item)
        previous = self.session.conversation.add(item) if response.in_conversation else None
        send = self.session.send
        send("response.output_item.added", response_id=response.id, output_index=response.index(item), item=item.json())
        if response.in_conversation:
            send("conversation.item.added", previous_item_id=previous, item=item.json())
        if item is response.item:
            kind = "audio" if item.parts[0].type == "output_audio" else "text"
            send("response.content_part.added", **self._where(response, item), part={"type": kind, "transcript": ""})

    @staticmethod
    def _where(response: Response, item: ConversationItem) -> dict[str, Any]:
        index = response.index(item) if item in response.outputs else 0
        return {"response_id": response.id, "item_id": item.id, "output_index": index, "content_index": 0}

    def _call_piece(self, response: Response, piece: ToolCallDelta) -> None:
        """A piece of a tool call the entry stage parsed: its item with the first, then its arguments."""
        call = response.calls.get(piece.index)
        if call is None:
            if response.in_conversation:
                self.session.check_room()
            call = ConversationItem(
                new_id("item"),
                "assistant",
                [],
                "in_progress",
                "function_call",
                piece.id or new_id("call"),
                piece.name or "",
            )
            response.calls[piece.index] = call
            self._add_output(response, call)
        if piece.arguments:
            call.arguments += piece.arguments
            self.session.send(
                "response.function_call_arguments.delta",
                response_id=response.id,
                item_id=call.id,
                output_index=response.index(call),
                call_id=call.call_id,
                delta=piece.arguments,
            )

    def _finish(self, response: Response, status: str, details: Any) -> None:
        send = self.session.send
        for item in response.outputs:
            index = response.index(item)
            if item.type == "function_call":
                send(
                    "response.function_call_arguments.done",
                    response_id=response.id,
                    item_id=item.id,
                    output_index=index,
                    call_id=item.call_id,
                    name=item.name,
                    arguments=item.arguments,
                )
            else:
                part, where = item.parts[0], self._where(response, item)
                if part.type == "output_audio":
                    send("response.output_audio.done", **where)
                    send("response.output_audio_transcript.done", **where, transcript=part.text)
                else:
                    send("response.output_text.done", **where, text=part.text)
                kind = "audio" if part.type == "output_audio" else "text"
                send("response.content_part.done", **where, part={"type": kind, "transcript": part.text})
            send("response.output_item.done", response_id=response.id, output_index=index, item=item.json())
            if response.in_conversation:
                send("conversation.item.done", item=item.json())
        send("response.done", response=self.response_json(response, status, details))

    def response_json(self, response: Response, status: str, details: Any = None) -> dict[str, Any]:
        u = response.usage
        return {
            "id": response.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [item.json() for item in response.outputs] if status != "in_progress" else [],
            "output_modalities": response.modalities,
            "conversation_id": self.session.id if response.in_conversation else None,
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
        response = self.active
        if response is None or response.task is None:
            return
        response.cancel_reason = reason
        if not response.finishing:
            response.task.cancel()
        await asyncio.gather(response.task, return_exceptions=True)
        if self.active is response:  # cancelled before its relay ran: it sent only response.created
            self.active, self.ended = None, time.monotonic()
            details = {"type": "cancelled", "reason": reason}
            self.session.send("response.done", response=self.response_json(response, "cancelled", details))
