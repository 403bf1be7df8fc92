"""The ingress deployment: the OpenAI-compatible routes in front of the graph.

Every route is the template of :mod:`omni_serve.api.serving`, in one short method bound from
:data:`ROUTES`: the key, the body read and validated (:mod:`omni_serve.api.http`: 400 naming the
field), the model it names and the route checked, then the route's own module turns the body into
the :class:`OmniRequest` beside its reply (``chat_request`` in :mod:`omni_serve.api.openai.chat`, and
so on: the voice included, before any stage runs), and :class:`Serving` runs it and answers with that
reply. The ingress is what those conversion functions are given (their
:class:`~omni_serve.api.openai.route.RouteContext`): the graph's facts, request ids and deadlines,
sampling (:mod:`omni_serve.api.sampling`) and the graph's voices. Video jobs run apart from their
HTTP requests (:mod:`omni_serve.api.video_jobs`); calling the stages is the transport's
(:mod:`omni_serve.graph.transport`).

Request ids: the server mints one per request (the response's ``id``); the client's
``X-Request-ID`` is a label for logs (Serve's proxy echoes it in the response header, or
its own id when the client sent none) and never reaches an engine: the orchestrator
derives each stage call's engine id from the server's id.
"""

# No `from __future__ import annotations`: FastAPI resolves route annotations at runtime and the
# ingress class travels to its replica by value, where string annotations no longer resolve.

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Any, TypeVar

from fastapi import FastAPI, Request, WebSocket
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from omni_serve.api import hosts, playground
from omni_serve.api.auth import key_ring
from omni_serve.api.context import IngressContext
from omni_serve.api.failure_status import stage_bad_request
from omni_serve.api.hosts import TrustedHosts, TrustedOrigins
from omni_serve.api.http import check_json_or_form, read_json_or_form, upload
from omni_serve.api.openai.chat import ChatCompletionRequest, chat_request
from omni_serve.api.openai.errors import APIError, bad_request, http_exception_handler
from omni_serve.api.openai.images import (
    ImageEditRequest,
    ImageGenerationRequest,
    ImagesReply,
    edit_image,
    image_edit_request,
    image_generation_request,
)
from omni_serve.api.openai.speech import SpeechRequest, speech_request
from omni_serve.api.openai.transcriptions import TranscriptionRequest, audio_file, transcription_request
from omni_serve.api.openai.videos import VideoCreateRequest, input_reference, list_query, video_request
from omni_serve.api.openai.voices import voices_json
from omni_serve.api.realtime.admission import Sessions
from omni_serve.api.realtime.connection import serve_session
from omni_serve.api.realtime.session_graph import SessionGraph
from omni_serve.api.realtime.vad import VadWorkers
from omni_serve.api.serving import Serving
from omni_serve.api.video_jobs import JobsClient, owner_of, unpack
from omni_serve.exceptions import InvalidStageInput
from omni_serve.graph.config import DEADLINE_MARGIN_S, GraphConfig, check_timeouts, load_graph
from omni_serve.graph.metrics import RequestMetrics
from omni_serve.graph.orchestrator import Orchestrator
from omni_serve.graph.readiness import ServeView
from omni_serve.graph.settings import ingress_graph
from omni_serve.graph.stage import Stage
from omni_serve.graph.stage_log import StageLog
from omni_serve.graph.transport import LocalStage, RemoteStages, StageTransport
from omni_serve.media import inputs as media_input
from omni_serve.payload import payload_loads
from omni_serve.types import Modality

logger = logging.getLogger("ray.serve")

Body = TypeVar("Body", bound=BaseModel)

api = FastAPI(title="omni_serve", docs_url=None, redoc_url=None, openapi_url=None)  # no route outside the API key
api.add_middleware(TrustedOrigins)  # every request that acts: the Origin check (omni_serve.api.hosts)
api.add_middleware(TrustedHosts)  # every route and the websocket: the Host check, outermost (added last)


@api.exception_handler(APIError)
async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return err.response()


@api.exception_handler(InvalidStageInput)
async def _invalid_input(request: Request, err: InvalidStageInput) -> JSONResponse:
    """What a route's own checks refuse (a media part's format, a video's size), as the stages' 400s are."""
    return stage_bad_request(err).response()


api.add_exception_handler(StarletteHTTPException, http_exception_handler)  # 404/405 as OpenAI errors
playground.mount(api)  # GET / (the playground page) and GET /stages


# The routes, bound to the methods of their names (as Ray Serve LLM binds its endpoints): the whole API in one
# table. Every route but /health checks the key first; the playground's two routes are omni_serve.api.playground's.
ROUTES: dict[str, tuple[str, str]] = {
    "health": ("GET", "/health"),
    "models": ("GET", "/v1/models"),
    "audio_voices": ("GET", "/v1/audio/voices"),
    "chat_completions": ("POST", "/v1/chat/completions"),
    "audio_transcriptions": ("POST", "/v1/audio/transcriptions"),
    "realtime": ("WEBSOCKET", "/v1/realtime"),
    "audio_speech": ("POST", "/v1/audio/speech"),
    "images_generations": ("POST", "/v1/images/generations"),
    "images_edits": ("POST", "/v1/images/edits"),
    "videos_create": ("POST", "/v1/videos"),
    "videos_retrieve": ("GET", "/v1/videos/{video_id}"),
    "videos_delete": ("DELETE", "/v1/videos/{video_id}"),
    "videos_content": ("GET", "/v1/videos/{video_id}/content"),
    "videos_list": ("GET", "/v1/videos"),
}

Routed = TypeVar("Routed", bound=type)


def _routed(cls: Routed) -> Routed:
    """``cls`` with each of its ROUTES methods bound to ``api`` (before Serve wraps the class with the app)."""
    for name, (method, path) in ROUTES.items():
        endpoint = getattr(cls, name)
        if method == "WEBSOCKET":
            api.websocket(path)(endpoint)
        else:
            api.api_route(path, methods=[method])(endpoint)
    return cls


@serve.deployment(max_ongoing_requests=64, max_queued_requests=256, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
@_routed
class Ingress:
    """The ingress deployment (bound to Serve with its routes below): the shared context every route's
    conversion function is given (its RouteContext), and one short method per route."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, graph: dict[str, Any], stages: dict[str, DeploymentHandle], media: dict[str, Any] | None = None
    ):
        self.graph: GraphConfig = load_graph(graph)
        # engine_in_ingress: the graph's one stage runs here, called in process (no handle, no Ray objects).
        self.local: Stage | None = None
        transport: StageTransport
        if self.graph.engine_in_ingress:
            self.local = Stage(self.graph.entry.model_dump(mode="json"), media)
            await self.local.start()
            transport = LocalStage(self.local)
        else:
            transport = RemoteStages(stages)
        self.transport = transport
        self.serving = Serving(Orchestrator(self.graph, transport), RequestMetrics())
        self.args = graph  # the graph's args as deployed: the run-time settings go over them (reconfigure)
        app = serve.get_replica_context().app_name
        self.serve_view = ServeView(app, {s.name: self.graph.deployment(s.name) for s in self.graph.stages})
        self.videos = JobsClient(app, self.graph, stages)
        http_options = self.serve_view.http_options()
        # The origins again and the key check (hosts.check_exposure) are reconfigure's: Serve calls it right after
        # this constructor, and at every settings change, with the user_config, whose api_key counts too.
        hosts.configure(http_options.host, self.graph.allowed_hosts, self.graph.allowed_origins)
        # Serve's own limit; the ingress answers 504 before it (see check_timeouts).
        timeout = http_options.request_timeout_s
        request_timeout_s = float(timeout) if timeout and timeout > 0 else None
        check_timeouts(self.graph.stage_timeout_s, request_timeout_s)
        self.context = context = IngressContext(self.graph, transport, request_timeout_s)
        playground.configure(self.graph, context.check_auth, self.serve_view)
        realtime = self.graph.realtime
        self.session_graph = SessionGraph(
            model=self.graph.served_model_name,
            outputs=self.serving.outputs,
            sampling=context.sampling,
            voice=context.voice,
            stage_log=functools.partial(StageLog, self.graph),
            text_stage=context.text_stage,
            speaks=Modality.AUDIO in self.graph.modalities,
            takes_audio=Modality.AUDIO in self.graph.input_modalities,
            max_audio_parts=self.graph.media_input.max_parts,
            max_audio_bytes=self.graph.media_input.max_bytes,
            limits=realtime,
            sessions=Sessions(realtime.max_sessions),
            vad=VadWorkers(realtime.audio_workers, keep_models=realtime.max_sessions),
            unavailable=context.unanswered("/v1/realtime"),
        )

    def reconfigure(self, user_config: Any, rank: Any = None) -> None:
        """Serve's hook for the deployment's ``user_config`` (omni_serve.graph.settings): the API keys, the stage
        timeout, the realtime limits and the video jobs' (handed to this replica's jobs actor), applied to this
        running replica; requests, sessions and jobs that start after it get them. Taking ``rank`` makes Serve
        call it also when the user_config is removed (the args' again), and right after the constructor when
        there is none: every start ends here, refused without a key off loopback (hosts.check_exposure) before
        the replica is ready, and a change that drops the key is refused."""
        graph = ingress_graph(self.args, user_config, self.context.request_timeout_s)
        api_key = key_ring(graph)
        bound = self.serve_view.http_options().host
        hosts.check_exposure(bound, has_key=api_key is not None, open_on_purpose=graph.allow_unauthenticated)
        self.context.api_key = api_key
        hosts.configure(bound, graph.allowed_hosts, graph.allowed_origins)
        self.serving.orchestrator.stage_timeout_s = graph.stage_timeout_s
        self.session_graph = dataclasses.replace(self.session_graph, limits=graph.realtime)
        self.videos.reconfigure(graph)

    # ---- the engine in this replica (engine_in_ingress): Serve's hooks, handle methods, shutdown ------
    async def check_health(self) -> None:
        if self.local is not None:
            await self.local.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The local engine's queue for ``omni_serve.graph.autoscaling`` (empty without one)."""
        return self.local.record_autoscaling_stats() if self.local is not None else {}

    def stats(self) -> dict[str, Any]:
        """The local stage's ``stats()`` (tests and benchmarks read them as a stage deployment's)."""
        if self.local is None:
            raise RuntimeError("this graph's stages run in deployments of their own: ask them")
        return self.local.stats()

    def __del__(self) -> None:
        local = getattr(self, "local", None)
        if local is not None:
            local.shutdown()  # Serve calls __del__ when the replica stops
        session_graph = getattr(self, "session_graph", None)
        if session_graph is not None:
            session_graph.vad.shutdown()

    # ---- not HTTP: handle methods for tests and operators -------------------------------------
    def payload_loads(self) -> dict[str, int]:
        """How many handoff payloads this process deserialized (the invariant says: none)."""
        return payload_loads()

    def buffered(self) -> dict[str, int]:
        """What the requests running in this replica hold for their clients (omni_serve.graph.flow)."""
        return self.serving.orchestrator.buffered()

    def media_decodes(self) -> dict[str, int]:
        """How many media items this process decoded (the invariant says: none; the entry stage decodes)."""
        return media_input.decodes()

    def realtime_stats(self) -> dict[str, Any]:
        """This replica's realtime sessions: how many, the bytes each holds, its pending transcriptions, and
        the seconds of audio the VAD scored (work done: the CPU it costs is bounded by the audio budget)."""
        return {**self.session_graph.sessions.stats(), "vad_audio_s": self.session_graph.vad.audio_s}

    # ---- what the routes share (the rest is the IngressContext's) ---------------------------------
    def _video_owner(self, request: Request) -> str:
        """Auth first (every route but /health answers 401 without the key, whatever the graph serves), then
        404 on a graph that makes no video (the routes exist only where videos do); whose jobs it sees."""
        client = self.context.check_auth(request)
        if self.context.routes["/v1/videos"] is not None:
            raise APIError(404, "Not Found", type="invalid_request_error")
        return owner_of(client, request.headers.get("authorization"))

    # ---- the routes, each bound from ROUTES below ---------------------------------------------------
    async def health(self) -> JSONResponse:
        """200 when every stage has a running replica; 503 naming the stages loading or down, or when
        Serve's controller has not answered for ``readiness.STALE_S`` seconds.

        Reads Serve's controller (:mod:`omni_serve.graph.readiness`), so a saturated graph answers at once.
        """
        status, body = await self.serve_view.health()
        return JSONResponse(body, status_code=status)

    async def models(self, request: Request) -> JSONResponse:
        self.context.check_auth(request)
        card: dict[str, Any] = {
            "id": self.context.model,
            "object": "model",
            "created": 0,
            "owned_by": "omni_serve",
            "modalities": sorted(m.value for m in self.graph.modalities),
            "input_modalities": [m.value for m in self.graph.input_modalities],
            "stages": [s.name for s in self.graph.stages],
            # The routes this graph answers (by its final outputs and what its entry stage takes).
            "routes": [route for route, why in self.context.routes.items() if why is None],
        }
        if Modality.AUDIO in self.graph.modalities:
            try:
                voices = await asyncio.wait_for(self.context.graph_voices(), 10)
                listed = voices_json(voices, self.graph.voice_aliases)
                card.update(voices=listed["voices"], voice_aliases=listed["aliases"])
            except Exception as err:  # stages not up yet: the card without voices
                logger.info("models: voices not known yet (%s)", type(err).__name__)
        return JSONResponse({"object": "list", "data": [card]})

    async def audio_voices(self, request: Request) -> JSONResponse:
        """vLLM-Omni's route: the voices a request may name, plus the graph's aliases."""
        self.context.check_auth(request)
        self.context.check_model(None, "/v1/audio/voices")
        return JSONResponse(voices_json(await self.context.graph_voices(), self.graph.voice_aliases))

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()  # vLLM-Omni's stage timings count from the request's arrival
        body = await self.context.body(request, ChatCompletionRequest, "/v1/chat/completions")
        omni, reply = await chat_request(body, request, self.context, arrived)
        return await self.serving.respond(omni, "chat", reply, stream=body.stream)

    async def audio_transcriptions(self, request: Request) -> Response:
        """OpenAI's transcription API on a graph whose thinker takes audio: the thinker alone transcribes."""
        body, files = await self.context.upload(request, TranscriptionRequest, "/v1/audio/transcriptions")
        audio, fmt = upload(audio_file(files), "audio", "file", self.graph.media_input.max_bytes)
        omni, reply = transcription_request(body, audio, fmt, request, self.context)
        streamed = body.stream or body.response_format == "text"
        return await self.serving.respond(omni, "transcriptions", reply, stream=streamed)

    async def realtime(self, websocket: WebSocket) -> None:
        """OpenAI's Realtime API (:mod:`omni_serve.api.realtime`): a session lives on this replica."""
        timeout = self.context.serve_timeout_s(websocket.headers)
        serve_limit = None if timeout is None else max(1.0, timeout - DEADLINE_MARGIN_S)
        await serve_session(websocket, self.session_graph, self.context.api_key, serve_limit)

    async def audio_speech(self, request: Request) -> Response:
        body = await self.context.body(request, SpeechRequest, "/v1/audio/speech")
        omni, reply = await speech_request(body, request, self.context)
        return await self.serving.respond(omni, "speech", reply, stream=True)

    async def images_generations(self, request: Request) -> Response:
        """OpenAI images API on a graph with an image final output: PNGs as b64_json."""
        body = await self.context.body(request, ImageGenerationRequest, "/v1/images/generations")
        omni = image_generation_request(body, request, self.context)
        return await self.serving.respond(omni, "images", ImagesReply(), stream=False)

    async def images_edits(self, request: Request) -> Response:
        """OpenAI's image edit (multipart: ``image``, the instruction in ``prompt``) on a graph whose image stage
        takes images."""
        body, files = await self.context.upload(request, ImageEditRequest, "/v1/images/edits")
        image, _ = upload(edit_image(files), "image", "image", self.graph.media_input.max_bytes)
        omni = image_edit_request(body, image, request, self.context)
        return await self.serving.respond(omni, "images", ImagesReply(), stream=False)

    # /v1/videos: OpenAI's video jobs, run by this replica's jobs actor (omni_serve.api.video_jobs)
    async def videos_create(self, request: Request) -> JSONResponse:
        """OpenAI's video API: the job answers at once (queued) and runs apart from this request."""
        self.context.check_auth(request)
        check_json_or_form(request.headers.get("content-type"))  # the 415 first, as on every POST route
        owner = self._video_owner(request)
        files: dict[str, bytes] = {}
        body = await read_json_or_form(request, self.graph.max_request_bytes, VideoCreateRequest, files.update)
        self.context.check_model(body.model, "/v1/videos")
        rules = await self.videos.rules()
        reference = input_reference(files, rules)
        image = None
        if reference is not None:
            image, _ = upload(reference, "image", "input_reference", self.graph.media_input.max_bytes)
        omni, job = video_request(body, image, rules, owner, request, self.context)
        return JSONResponse(await self.videos.create(job, omni))

    async def videos_retrieve(self, video_id: str, request: Request) -> JSONResponse:
        owner = self._video_owner(request)
        return JSONResponse(unpack(await self.videos.ask(video_id, "get", owner))["job"])

    async def videos_delete(self, video_id: str, request: Request) -> JSONResponse:
        """Forget the job; a running one's stage call is cancelled, which aborts its engine request."""
        owner = self._video_owner(request)
        return JSONResponse(unpack(await self.videos.ask(video_id, "delete", owner))["job"])

    async def videos_content(self, video_id: str, request: Request) -> Response:
        """The MP4, read from the object store by reference and streamed out (never copied whole here)."""
        owner = self._video_owner(request)
        variant = request.query_params.get("variant", "video")
        if variant != "video":
            raise bad_request(f"variant: only 'video' is made (got '{variant:.40}')", "variant")
        data = await self.videos.video(video_id, owner)

        async def chunks() -> Any:
            for start in range(0, len(data), 1 << 20):
                yield bytes(data[start : start + (1 << 20)])

        headers = {"content-length": str(len(data)), "content-disposition": f'attachment; filename="{video_id}.mp4"'}
        return StreamingResponse(chunks(), media_type="video/mp4", headers=headers)

    async def videos_list(self, request: Request) -> JSONResponse:
        """The caller's jobs on every ingress replica of this application (JobsClient.page)."""
        owner = self._video_owner(request)  # before the query: a client without the key learns nothing of it
        return JSONResponse(await self.videos.page(owner, *list_query(request.query_params)))
