"""``input_audio_transcription``: each committed user turn transcribed beside the conversation.

A transcription is the transcription route's request (the thinker alone, the same turn and the same
validated sampling) over the turn's audio. A session runs one at a time, so a client that commits
faster than the thinker transcribes queues here, not in the graph; the queue holds at most
``max_pending_transcriptions`` (running and waiting): a turn committed beyond it is not transcribed
(an ``error`` event and ``...transcription.failed`` for its item), so what a session queues is bounded.
A transcript cut at the thinker's ``max_tokens`` says so: ``finish_reason: "length"`` on
``...transcription.completed``, as on ``/v1/audio/transcriptions``.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Protocol

from omni_serve.api.openai.errors import APIError
from omni_serve.api.openai.sampling import SamplingRequest
from omni_serve.api.openai.transcriptions import Transcript, transcription_messages
from omni_serve.api.openai.transcriptions import usage_json as transcription_usage
from omni_serve.api.realtime import events as ev
from omni_serve.api.realtime.conversation import ConversationItem
from omni_serve.api.realtime.session_graph import SessionGraph
from omni_serve.graph.config import RealtimeConfig
from omni_serve.graph.request import OmniRequest
from omni_serve.types import MediaPart, Modality


class Session(Protocol):
    """What a transcription uses of its session (:class:`~omni_serve.api.realtime.session.Session`)."""

    graph: SessionGraph
    limits: RealtimeConfig

    def send(self, kind: str, **fields: Any) -> None: ...

    def error(self, error: APIError, event_id: str | None) -> None: ...

    def fit(self) -> None: ...


class Transcriptions:
    def __init__(self, session: Session):
        self.session = session
        self.tasks: set[asyncio.Task[None]] = set()  # running and waiting
        self._one_at_a_time = asyncio.Semaphore(1)

    def start(self, item: ConversationItem, options: ev.Transcription, event_id: str | None) -> None:
        """Transcribe ``item`` (just committed) when the ones before it are done, or refuse it when too many wait."""
        limit = self.session.limits.max_pending_transcriptions
        if len(self.tasks) >= limit:
            error = APIError(
                429,
                f"{len(self.tasks)} transcriptions are pending (realtime.max_pending_transcriptions): item "
                f"{item.id} is not transcribed",
                type="rate_limit_error",
                code="too_many_pending_transcriptions",
            )
            self.session.error(error, event_id)
            failed = "conversation.item.input_audio_transcription.failed"
            self.session.send(failed, item_id=item.id, content_index=0, error=error.body()["error"])
            return
        task = asyncio.create_task(self._queued(item, options))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _queued(self, item: ConversationItem, options: ev.Transcription) -> None:
        async with self._one_at_a_time:
            await self._transcribe(item, options)

    async def _transcribe(self, item: ConversationItem, options: ev.Transcription) -> None:
        session, graph = self.session, self.session.graph
        where = {"item_id": item.id, "content_index": 0}
        audio = [p for p in item.chat_message().content if isinstance(p, MediaPart)]
        if not audio:  # its audio was dropped to keep the session in its bytes before its turn came
            error = APIError(400, "the item's audio is no longer held", type="invalid_request_error")
            session.send("conversation.item.input_audio_transcription.failed", **where, error=error.body()["error"])
            return
        request = OmniRequest(
            request_id=uuid.uuid4().hex,
            modalities={Modality.TEXT},
            sampling=graph.sampling(SamplingRequest()),
            messages=transcription_messages(audio[0], options.language, options.prompt),
            stage_log=graph.stage_log(),
        )
        transcript = Transcript(graph.text_stage)
        outputs = graph.outputs(request, "transcriptions")
        try:
            async for output in outputs:
                transcript.add(output)
                if output.text:
                    session.send("conversation.item.input_audio_transcription.delta", **where, delta=output.text)
        except APIError as err:
            error = err.body()["error"]
            session.send("conversation.item.input_audio_transcription.failed", **where, error=error)
            return
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        text = "".join(transcript.text)
        item.parts[0].text = text
        session.fit()
        session.send(
            "conversation.item.input_audio_transcription.completed",
            **where,
            transcript=text,
            usage=transcription_usage(transcript.usage),
            finish_reason=transcript.finish_reason.value,
        )

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
