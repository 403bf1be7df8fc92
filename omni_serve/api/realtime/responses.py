"""A session's responses: ``response.create`` -> a graph request over the conversation -> events, until
``response.done``.

A response is an ordinary graph request: the conversation so far becomes the thinker's turns and runs
through the same :class:`~omni_serve.graph.orchestrator.OmniRequest`, the same sampling resolution
(validated as a chat completion's: one set of bounds) and the same
:meth:`~omni_serve.api.serving.Serving.outputs` as a chat completion. Cancelling it
(``response.cancel``, barge-in, the session's end) cancels the task that reads the graph's outputs,
which is the cancellation a chat client's disconnect makes: the orchestrator aborts every stage call
it started. A session runs one response at a time.

``response.done`` says how it ended: ``completed``; ``incomplete`` with reason ``max_output_tokens``
when any stage stopped at its ``max_tokens`` (the thinker's reply, or the talker's speech, cut
short); ``cancelled`` with the reason; ``failed`` with the error.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from omni_serve.api.openai.chat import SamplingRequest
from omni_serve.api.openai.errors import APIError, bad_request, from_validation
from omni_serve.api.realtime import events as ev
from omni_serve.api.realtime.conversation import Conversation, ConversationItem, Part, new_id
from omni_serve.api.realtime.session_graph import SessionGraph
from omni_serve.api.realtime.settings import Settings
from omni_serve.graph.orchestrator import OmniRequest
from omni_serve.media.encode import b64, encode_audio
from omni_serve.types import Modality, SamplingParams, Usage


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

    def fit(self) -> None: ...


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


def sampling_of(session: Session, params: ev.ResponseParams, limit: int | str) -> dict[str, SamplingParams]:
    """The response's per-stage sampling, validated and resolved exactly as a chat completion's
    (``response.`` names the field in an error)."""
    fields: dict[str, Any] = {"seed": params.seed, "stage_sampling": params.stage_sampling}
    if isinstance(limit, int):
        fields["max_completion_tokens"] = limit
    try:
        return session.graph.sampling(SamplingRequest.model_validate(fields))
    except ValidationError as err:
        raise _named(from_validation(err), "response.") from None
    except APIError as err:
        raise _named(err, "response.") from None


def _named(error: APIError, prefix: str) -> APIError:
    if error.param:
        error.message = error.message.replace(error.param, f"{prefix}{error.param}", 1)
        error.param = f"{prefix}{error.param}"
    return error


class Responses:
    """The session's active response, if any: creating, relaying, cancelling it."""

    def __init__(self, session: Session):
        self.session = session
        self.active: Response | None = None

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
        )
        kind = "output_audio" if modalities == ["audio"] else "output_text"
        item = ConversationItem(new_id("item"), "assistant", [Part(kind)], status="in_progress")
        response = Response(f"resp_{request.request_id[:20]}", item, modalities, in_conversation, params.metadata)
        self.active = response
        self.session.send("response.created", response=self.response_json(response, "in_progress"))
        response.task = asyncio.create_task(self._relay(response, request))

    async def _relay(self, response: Response, request: OmniRequest) -> None:
        """Stream one response's outputs as events; always ends with ``response.done``."""
        session, graph = self.session, self.session.graph
        item, part = response.item, response.item.parts[0]
        audio = part.type == "output_audio"
        where = {"response_id": response.id, "item_id": item.id, "output_index": 0, "content_index": 0}
        status, details = "completed", None
        outputs = graph.outputs(request, "realtime")
        try:
            previous = session.conversation.add(item) if response.in_conversation else None
            session.send("response.output_item.added", response_id=response.id, output_index=0, item=item.json())
            if response.in_conversation:
                session.send("conversation.item.added", previous_item_id=previous, item=item.json())
            session.send(
                "response.content_part.added", **where, part={"type": "audio" if audio else "text", "transcript": ""}
            )
            async for output in outputs:
                if output.text:
                    part.text += output.text
                    kind = "response.output_audio_transcript.delta" if audio else "response.output_text.delta"
                    session.send(kind, **where, delta=output.text)
                if output.audio is not None and audio:
                    if output.sample_rate != ev.PCM_RATE:
                        raise APIError(
                            500, f"the graph's audio is {output.sample_rate} Hz, not 24000", type="server_error"
                        )
                    pcm = encode_audio(output.audio, ev.PCM_RATE, "pcm")
                    session.spoke = True
                    session.send("response.output_audio.delta", **where, delta=b64(pcm))
                    if response.in_conversation:  # kept for conversation.item.retrieve / .truncate
                        part.audio += pcm
                        session.fit()
                if output.stage == graph.text_stage and output.usage:
                    response.usage = output.usage
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
        item.status = "completed" if status == "completed" else "incomplete"
        try:
            self._finish(response, status, details, where)
        finally:
            self.active = None

    def _finish(self, response: Response, status: str, details: Any, where: dict[str, Any]) -> None:
        send = self.session.send
        item, part = response.item, response.item.parts[0]
        if part.type == "output_audio":
            send("response.output_audio.done", **where)
            send("response.output_audio_transcript.done", **where, transcript=part.text)
        else:
            send("response.output_text.done", **where, text=part.text)
        kind = "audio" if part.type == "output_audio" else "text"
        send("response.content_part.done", **where, part={"type": kind, "transcript": part.text})
        send("response.output_item.done", response_id=response.id, output_index=0, item=item.json())
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
            "output": [response.item.json()] if status != "in_progress" else [],
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
            self.active = None
            details = {"type": "cancelled", "reason": reason}
            self.session.send("response.done", response=self.response_json(response, "cancelled", details))
