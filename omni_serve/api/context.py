"""What every route of one ingress replica shares: the key, the body, the model check, and the RouteContext.

The ingress holds one :class:`IngressContext` and hands it to each route's conversion function as its
:class:`~omni_serve.api.openai.route.RouteContext`: the graph's facts, a request's server-minted id and
deadline, each stage's sampling, the graph's voices (asked from the stages once).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel
from ray.serve._private.http_util import parse_request_timeout_header
from starlette.requests import Request

from omni_serve.api.auth import check_auth, key_ring
from omni_serve.api.failure_status import from_failure
from omni_serve.api.http import read_json, read_upload
from omni_serve.api.openai.audio_replies import AudioReplies
from omni_serve.api.openai.errors import APIError
from omni_serve.api.openai.messages import MediaRules
from omni_serve.api.openai.sampling import SamplingRequest
from omni_serve.api.openai.voices import resolve_voice
from omni_serve.api.sampling import StageSampling
from omni_serve.graph.config import DEADLINE_MARGIN_S, GraphConfig
from omni_serve.graph.orchestrator import StageFailed
from omni_serve.graph.request import OmniRequest
from omni_serve.graph.stage_log import StageLog
from omni_serve.graph.transport import StageTransport
from omni_serve.types import Modality, SamplingParams

Body = TypeVar("Body", bound=BaseModel)


class IngressContext:
    """One ingress replica's shared context (a RouteContext). ``api_key`` is the run-time settings' (reconfigure)."""

    def __init__(self, graph: GraphConfig, transport: StageTransport, request_timeout_s: float | None):
        self.graph = graph
        self.transport = transport  # the graph's voices are asked through it
        self.request_timeout_s = request_timeout_s  # Serve's own limit (a request's header may override it)
        self.api_key = key_ring(graph)  # None: no key (omni_serve.api.auth)
        self.model = graph.served_model_name
        self.modalities = graph.modalities
        self.text_stage = next((s.name for s in graph.stages if s.final_output is Modality.TEXT), None)
        self.entry_stage, self.entry_prompt = graph.entry.name, graph.entry_prompt
        # What this graph answers, by its final outputs and its entry stage: None, or why not (GraphConfig.routes).
        self.routes = graph.routes()
        self.media_rules = MediaRules(
            frozenset(m.value for m in graph.input_modalities), graph.media_policy, graph.media_input
        )
        # An upload's body: its file at the media limit, and the form's fields beside it.
        self.upload_bytes = max(graph.max_request_bytes, graph.media_input.max_bytes + (64 << 10))
        self.audio_replies = AudioReplies()  # transcripts of this replica's audio replies, for later turns
        self.stage_sampling = StageSampling(graph)
        self._voices: list[str] | None = None  # asked from the stages once, on first need

    def check_auth(self, request: Request) -> str:
        """The client making the request (omni_serve.api.auth), or 401."""
        return check_auth(request.headers.get("authorization"), self.api_key)

    async def body(self, request: Request, model: type[Body], route: str) -> Body:
        """The key, then the JSON body validated as ``model``, then the model it names and the route checked."""
        self.check_auth(request)
        body = await read_json(request, self.graph.max_request_bytes, model)
        self.check_model(getattr(body, "model", None), route)
        return body

    async def upload(self, request: Request, model: type[Body], route: str) -> tuple[Body, dict[str, bytes]]:
        """As :meth:`body` for a multipart upload: its fields validated as ``model``, and its files."""
        self.check_auth(request)
        body, files = await read_upload(request, self.upload_bytes, model)
        self.check_model(getattr(body, "model", None), route)
        return body, files

    def check_model(self, model: str | None, route: str) -> None:
        """The model the request names is this graph's, and the graph answers ``route`` (else a 4xx saying why)."""
        if model is not None and model != self.model:
            raise APIError(
                404,
                f"model '{model}' does not exist; this server serves '{self.model}'",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        why = self.unanswered(route)
        if why is not None:
            raise APIError(400, why, type="invalid_request_error", param="model", code="unsupported_route")

    def unanswered(self, route: str) -> str | None:
        why = self.routes[route]
        return None if why is None else f"model '{self.model}' does not answer {route}: {why}"

    def request(self, http: Request, arrived: float | None = None, **fields: Any) -> OmniRequest:
        """The internal request with its server-minted id, its deadline and its stage log (what its stages did,
        read by the reply: which stage stopped at its max_tokens, vLLM-Omni's stage metrics)."""
        return OmniRequest(
            request_id=uuid.uuid4().hex,
            client_request_id=http.headers.get("x-request-id") or None,
            deadline=self._deadline(http),
            stage_log=StageLog(self.graph, start=arrived),
            **fields,
        )

    def sampling(self, body: SamplingRequest) -> dict[str, SamplingParams]:
        return self.stage_sampling.for_request(body)

    def sampling_defaults(self, seed: int | None) -> dict[str, SamplingParams]:
        return self.stage_sampling.defaults(seed)

    def serve_timeout_s(self, headers: Mapping[str, str]) -> float | None:
        """Serve's request_timeout_s for a request with these headers (its per-request header override included)."""
        raw = {k.encode("latin-1"): v.encode("latin-1") for k, v in headers.items()}
        return parse_request_timeout_header(raw, self.request_timeout_s)

    def _deadline(self, request: Request) -> float | None:
        """Serve's limit for this request (its header override included), less a margin, as a monotonic time."""
        timeout = self.serve_timeout_s(request.headers)
        return None if timeout is None else time.monotonic() + max(0.0, timeout - DEADLINE_MARGIN_S)

    async def graph_voices(self) -> list[str]:
        """The voices the graph's stages declare (asked once; the graph's stages never change under an ingress).

        A stage that cannot answer fails the request like any stage call (e.g. 503 naming it).
        """
        if self._voices is None:

            async def ask(stage: str) -> list[str]:
                try:
                    return await self.transport.voices(stage)
                except Exception as err:
                    raise from_failure(StageFailed(stage, err), "voices") from None

            declared = await asyncio.gather(*(ask(s.name) for s in self.graph.stages))
            self._voices = sorted({voice.lower() for voices in declared for voice in voices})
        return self._voices

    async def voice(self, requested: str | None, param: str) -> str | None:
        if requested is None:
            return None
        return resolve_voice(requested, await self.graph_voices(), self.graph.voice_aliases, param)
