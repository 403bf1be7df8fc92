"""The one serving template every route follows: validate -> internal request -> run the graph -> look
at the first item that decides the status -> JSON, SSE or an audio stream.

(The references: Ray Serve LLM's ``_peek_at_generator``, SGLang's ``OpenAIServingBase.handle_request``.)
A route validates its body (400 naming the field, before any stage runs), builds its
:class:`OmniRequest`, and hands it to :meth:`Serving.respond` with its reply builder (the API layer's
``ChatReply``, ``SpeechReply``, ``ImagesReply``). The status is decided before the response starts:
a JSON reply collects everything first; a streamed one waits for the first output that decides it
(speech: the first audio chunk; a ``text`` transcription: its end, so its header can say how it
finished), so failures that happen early still get a real status code. A
failure after that is the reply builder's to report in band (the same error object as an SSE event),
or it cuts the body short (audio), which a client sees as a broken transfer, never a complete file.

Failures are classified once, where the graph's outputs come out (:meth:`Serving.outputs`), by
:func:`omni_serve.api.failure_status.from_failure`; the request metrics record that status.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from omni_serve.api.failure_status import from_failure
from omni_serve.api.openai.errors import APIError
from omni_serve.graph.metrics import RequestMetrics
from omni_serve.graph.orchestrator import Orchestrator
from omni_serve.graph.request import OmniRequest
from omni_serve.types import StageOutput


class Reply(Protocol):
    """How one route turns the graph's outputs into its response body."""

    @property
    def media_type(self) -> str:
        """The streamed body's Content-Type."""

    def decides_status(self, output: StageOutput) -> bool:
        """Whether ``output`` is the one a streamed reply waits for before it sends the status line."""

    def headers(self, head: list[StageOutput]) -> dict[str, str]:
        """A streamed reply's headers, decided with its status from the outputs up to the deciding one."""

    async def json(self, outputs: AsyncIterator[StageOutput]) -> dict[str, Any]:
        """The whole reply as a JSON body."""

    def stream(self, outputs: AsyncIterator[StageOutput]) -> AsyncIterator[str] | AsyncIterator[bytes]:
        """The reply as body pieces, sent as they are made."""

    def in_band_error(self, error: APIError) -> str | bytes | None:
        """What to send when the request fails after the status line (None: cut the body short)."""


class ServeStreamingResponse(StreamingResponse):
    """Starlette's streaming response, sent the way it sends to ASGI 2.4 servers: no disconnect listener.

    Behind an ASGI < 2.4 server Starlette runs the body in an anyio task group next to a task that
    waits for ``http.disconnect``, and cancels the group at the end; anyio builds the current task's
    repr for that cancel, reading source files (~9% of the ingress's CPU at 8 concurrent streams,
    py-spy). Under Serve the listener is redundant: when the client leaves, Serve cancels the ingress's
    call (its proxy, or the replica's own HTTP server behind HAProxy), which cancels this response and
    the orchestrator's stage calls (``tests/test_cancellation.py``; ``tests/test_vllm_engine.py`` for an
    engine in the ingress).
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__({**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}, receive, send)


class Serving:
    """Runs validated requests through the graph and answers them, for every route of one ingress."""

    def __init__(self, orchestrator: Orchestrator, metrics: RequestMetrics):
        self.orchestrator = orchestrator
        self.metrics = metrics

    async def respond(self, request: OmniRequest, route: str, reply: Reply, *, stream: bool) -> Response:
        outputs = self.outputs(request, route)
        if not stream:
            try:
                return JSONResponse(await reply.json(outputs))
            finally:
                await outputs.aclose()
        try:
            head = await _peek(outputs, reply.decides_status)
            headers = reply.headers(head)
        except BaseException:
            await outputs.aclose()
            raise
        return ServeStreamingResponse(_body(head, outputs, reply), media_type=reply.media_type, headers=headers)

    async def outputs(self, request: OmniRequest, route: str) -> AsyncGenerator[StageOutput, None]:
        """The graph's outputs for one request, timed; any failure leaves as the one APIError it maps to."""
        timer = self.metrics.timer(route)
        status = 499  # the client left before the end
        try:
            async for item in self.orchestrator.run(request):
                timer.saw(item)
                yield item
            status = 200
        except APIError as err:
            status = err.status
            raise
        except Exception as err:
            error = from_failure(err, request.request_id)
            status = error.status
            raise error from None
        finally:
            timer.done(status)


async def _peek(outputs: AsyncGenerator[StageOutput, None], decides: Any) -> list[StageOutput]:
    """The outputs up to and including the first that ``decides`` the status (all of them if none does)."""
    head: list[StageOutput] = []
    async for output in outputs:
        head.append(output)
        if decides(output):
            break
    return head


async def _replay(head: list[StageOutput], outputs: AsyncGenerator[StageOutput, None]) -> AsyncIterator[StageOutput]:
    while head:
        yield head.pop(0)
    async for output in outputs:
        yield output


async def _body(
    head: list[StageOutput], outputs: AsyncGenerator[StageOutput, None], reply: Reply
) -> AsyncIterator[Any]:
    try:
        async for piece in reply.stream(_replay(head, outputs)):
            yield piece
    except APIError as error:
        tail = reply.in_band_error(error)
        if tail is None:
            raise
        yield tail
    finally:
        await outputs.aclose()
