"""The ingress deployment: the OpenAI-compatible routes in front of the graph.

Every route is the template of :mod:`omni_serve.api.serving`: parse and validate the body (400
naming the field, the voice included, before any stage runs), build the :class:`OmniRequest`, and
let :class:`Serving` run it and answer with the route's reply builder. This module holds the routes
and what they share (auth, the model name, request ids and deadlines, the graph's voices); sampling
resolution is :mod:`omni_serve.api.sampling`'s, calling the stages the transport's
(:mod:`omni_serve.graph.transport`).

Request ids: the server mints one per request (the response's ``id``); the client's
``X-Request-ID`` is a label for logs (Serve's proxy echoes it in the response header, or
its own id when the client sent none) and never reaches an engine: the orchestrator
derives each stage call's engine id from the server's id.
"""

# No `from __future__ import annotations`: FastAPI resolves route annotations at runtime and the
# ingress class travels to its replica by value, where string annotations no longer resolve.

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request, WebSocket
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve._private.http_util import parse_request_timeout_header
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from omni_serve.api import hosts, playground
from omni_serve.api.auth import check_auth, key_ring
from omni_serve.api.errors import from_failure, stage_bad_request
from omni_serve.api.hosts import TrustedHosts, TrustedOrigins
from omni_serve.api.http import check_content_type, parse_json_object, read_body, read_form
from omni_serve.api.openai.audio_replies import AudioReplies
from omni_serve.api.openai.chat import ChatCompletionRequest, ChatReply, SamplingRequest, StreamOptions
from omni_serve.api.openai.errors import APIError, bad_request, from_validation, http_exception_handler
from omni_serve.api.openai.images import ImageEditRequest, ImageGenerationRequest, ImagesReply
from omni_serve.api.openai.messages import MediaRules
from omni_serve.api.openai.speech import TTS_FIELDS, SpeechReply, SpeechRequest
from omni_serve.api.openai.transcriptions import TranscriptionReply, TranscriptionRequest, transcription_messages
from omni_serve.api.openai.videos import (
    VIDEO_BODIES,
    VideoCreateRequest,
    VideoJob,
    list_query,
    not_found,
    refuse_files,
    video_list,
)
from omni_serve.api.openai.voices import resolve_voice, voices_json
from omni_serve.api.realtime.admission import Sessions
from omni_serve.api.realtime.connection import serve_session
from omni_serve.api.realtime.session_graph import SessionGraph
from omni_serve.api.realtime.vad import VadWorkers
from omni_serve.api.sampling import StageSampling
from omni_serve.api.serving import Serving
from omni_serve.api.video_jobs import (
    VideoJobs,
    actor_key_in,
    actor_key_of,
    actor_name,
    jobs_graph,
    new_job_id,
    owner_of,
    unpack,
)
from omni_serve.graph.config import DEADLINE_MARGIN_S, GraphConfig, check_timeouts, load_graph
from omni_serve.graph.metrics import RequestMetrics
from omni_serve.graph.orchestrator import OmniRequest, Orchestrator, StageFailed
from omni_serve.graph.readiness import ServeView
from omni_serve.graph.settings import ingress_graph
from omni_serve.graph.stage import Stage
from omni_serve.graph.stage_log import StageLog
from omni_serve.graph.transport import LocalStage, RemoteStages, StageTransport
from omni_serve.media import inputs as media_input
from omni_serve.models import video_params
from omni_serve.payload import payload_loads
from omni_serve.types import ChatMessage, InvalidStageInput, MediaPart, Modality, TextPart, VideoRules

logger = logging.getLogger("ray.serve")

Body = TypeVar("Body", bound=BaseModel)

api = FastAPI(title="omni_serve", docs_url=None, redoc_url=None, openapi_url=None)  # no route outside the API key
api.add_middleware(TrustedOrigins)  # every request that acts: the Origin check (omni_serve.api.hosts)
api.add_middleware(TrustedHosts)  # every route and the websocket: the Host check, outermost (added last)


@api.exception_handler(APIError)
async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return err.response()


api.add_exception_handler(StarletteHTTPException, http_exception_handler)  # 404/405 as OpenAI errors
playground.mount(api)  # GET / (the playground page) and GET /stages


@serve.deployment(max_ongoing_requests=64, max_queued_requests=256, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Ingress:
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
        self._stage_handles = stages  # the video jobs actor calls the stages with them
        self._video_jobs: Any = None  # this replica's VideoJobs actor, started by the first video job
        self._video_jobs_key = ""  # its key (32 hex digits: the job ids name it)
        self._video_settings = jobs_graph(self.graph)  # its graph: the args, with the run-time settings over them
        self._peer_video_jobs: dict[str, Any] = {}  # other replicas' VideoJobs actors, by key
        self._video_rules: VideoRules | None = None  # the video stage's, asked once
        self.serving = Serving(Orchestrator(self.graph, transport), RequestMetrics())
        self.sampling = StageSampling(self.graph)
        self.args = graph  # the graph's args as deployed: the run-time settings go over them (reconfigure)
        self.api_key = key_ring(self.graph)  # None: no key (omni_serve.api.auth)
        self.serve_view = ServeView(
            serve.get_replica_context().app_name, {s.name: self.graph.deployment(s.name) for s in self.graph.stages}
        )
        http_options = self.serve_view.http_options()
        # The origins again and the key check (hosts.check_exposure) are reconfigure's: Serve calls it right after
        # this constructor, and at every settings change, with the user_config, whose api_key counts too.
        hosts.configure(http_options.host, self.graph.allowed_hosts, self.graph.allowed_origins)
        # Serve's own limit; the ingress answers 504 before it (see check_timeouts).
        timeout = http_options.request_timeout_s
        self.request_timeout_s = float(timeout) if timeout and timeout > 0 else None
        check_timeouts(self.graph.stage_timeout_s, self.request_timeout_s)
        self.text_stage = next((s.name for s in self.graph.stages if s.final_output is Modality.TEXT), None)
        # What this graph answers, by its final outputs and its entry stage: None, or why not (GraphConfig.routes).
        self.routes = self.graph.routes()
        self.media_rules = MediaRules(
            frozenset(m.value for m in self.graph.input_modalities), self.graph.media_policy, self.graph.media_input
        )
        self._voices: list[str] | None = None  # asked from the stages once, on first need
        self.audio_replies = AudioReplies()  # transcripts of this replica's audio replies, for later turns
        playground.configure(self.graph, self._check_auth, self.serve_view)
        realtime = self.graph.realtime
        self.session_graph = SessionGraph(
            model=self.graph.served_model_name,
            outputs=self.serving.outputs,
            sampling=self.sampling.for_request,
            voice=self._voice,
            stage_log=functools.partial(StageLog, self.graph),
            text_stage=self.text_stage,
            speaks=Modality.AUDIO in self.graph.modalities,
            takes_audio=Modality.AUDIO in self.graph.input_modalities,
            max_audio_parts=self.graph.media_input.max_parts,
            max_audio_bytes=self.graph.media_input.max_bytes,
            limits=realtime,
            sessions=Sessions(realtime.max_sessions),
            vad=VadWorkers(realtime.audio_workers, keep_models=realtime.max_sessions),
            unavailable=self._unanswered("/v1/realtime"),
        )

    def reconfigure(self, user_config: Any, rank: Any = None) -> None:
        """Serve's hook for the deployment's ``user_config`` (omni_serve.graph.settings): the API keys, the stage
        timeout, the realtime limits and the video jobs' (handed to this replica's jobs actor), applied to this
        running replica; requests, sessions and jobs that start after it get them. Taking ``rank`` makes Serve
        call it also when the user_config is removed (the args' again), and right after the constructor when
        there is none: every start ends here, refused without a key off loopback (hosts.check_exposure) before
        the replica is ready, and a change that drops the key is refused."""
        graph = ingress_graph(self.args, user_config, self.request_timeout_s)
        api_key = key_ring(graph)
        bound = self.serve_view.http_options().host
        hosts.check_exposure(bound, has_key=api_key is not None, open_on_purpose=graph.allow_unauthenticated)
        self.api_key = api_key
        hosts.configure(bound, graph.allowed_hosts, graph.allowed_origins)
        self.serving.orchestrator.stage_timeout_s = graph.stage_timeout_s
        self.session_graph = dataclasses.replace(self.session_graph, limits=graph.realtime)
        self._video_settings = jobs_graph(graph)  # the jobs actor's, now or when it starts
        if self._video_jobs is not None:
            self._video_jobs.reconfigure.remote(self._video_settings)  # in order before any later create

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

    # ---- what the routes share -----------------------------------------------------------------
    def _check_auth(self, request: Request) -> str:
        """The client making the request (omni_serve.api.auth), or 401."""
        return check_auth(request.headers.get("authorization"), self.api_key)

    async def _parse(self, request: Request, model: type[Body]) -> Body:
        self._check_auth(request)
        check_content_type(request.headers.get("content-type"))
        data = parse_json_object(await read_body(request, self.graph.max_request_bytes))
        try:
            return model.model_validate(data)
        except ValidationError as err:
            raise from_validation(err) from None

    def _check_model(self, model: str | None, route: str) -> None:
        """The model the request names is this graph's, and the graph answers ``route`` (else a 4xx saying why)."""
        if model is not None and model != self.graph.served_model_name:
            raise APIError(
                404,
                f"model '{model}' does not exist; this server serves '{self.graph.served_model_name}'",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        why = self._unanswered(route)
        if why is not None:
            raise APIError(400, why, type="invalid_request_error", param="model", code="unsupported_route")

    def _unanswered(self, route: str) -> str | None:
        why = self.routes[route]
        return None if why is None else f"model '{self.graph.served_model_name}' does not answer {route}: {why}"

    def _omni_request(self, request: Request, arrived: float | None = None, **fields: Any) -> OmniRequest:
        """The internal request with its server-minted id, its deadline and its stage log (what its stages did,
        read by the reply: which stage stopped at its max_tokens, vLLM-Omni's stage metrics)."""
        client_id = request.headers.get("x-request-id") or None
        return OmniRequest(
            request_id=uuid.uuid4().hex,
            client_request_id=client_id,
            deadline=self._deadline(request),
            stage_log=StageLog(self.graph, start=arrived),
            **fields,
        )

    def _deadline(self, request: Request) -> float | None:
        """Serve's limit for this request (its header override included), less a margin, as a monotonic time."""
        timeout = self._serve_timeout_s(request.headers)
        return None if timeout is None else time.monotonic() + max(0.0, timeout - DEADLINE_MARGIN_S)

    def _serve_timeout_s(self, headers: Mapping[str, str]) -> float | None:
        """Serve's request_timeout_s for a request with these headers (its per-request header override included)."""
        raw = {k.encode("latin-1"): v.encode("latin-1") for k, v in headers.items()}
        return parse_request_timeout_header(raw, self.request_timeout_s)

    async def _graph_voices(self) -> list[str]:
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

    async def _voice(self, requested: str | None, param: str) -> str | None:
        if requested is None:
            return None
        return resolve_voice(requested, await self._graph_voices(), self.graph.voice_aliases, param)

    def _modalities(self, body: ChatCompletionRequest) -> set[Modality]:
        wanted = set(body.modalities or [Modality.TEXT])
        missing = wanted - self.graph.modalities
        if missing:
            names = ", ".join(sorted(m.value for m in missing))
            offered = sorted(m.value for m in self.graph.modalities)
            raise bad_request(f"modalities: this graph cannot produce {names} (it offers {offered})", "modalities")
        return wanted

    def _chat_messages(self, body: ChatCompletionRequest) -> list[ChatMessage]:
        """The request's turns, media checked cheaply here (never decoded here: the entry stage decodes), earlier
        audio replies named by id as their transcripts."""
        try:
            return body.chat_messages(self.media_rules, self.audio_replies.transcript)
        except InvalidStageInput as err:
            raise stage_bad_request(err) from None

    # ---- routes --------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 when every stage has a running replica; 503 naming the stages loading or down, or when
        Serve's controller has not answered for ``readiness.STALE_S`` seconds.

        Reads Serve's controller (:mod:`omni_serve.graph.readiness`), so a saturated graph answers at once.
        """
        status, body = await self.serve_view.health()
        return JSONResponse(body, status_code=status)

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._check_auth(request)
        card: dict[str, Any] = {
            "id": self.graph.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "omni_serve",
            "modalities": sorted(m.value for m in self.graph.modalities),
            "input_modalities": [m.value for m in self.graph.input_modalities],
            "stages": [s.name for s in self.graph.stages],
            # The routes this graph answers (by its final outputs and what its entry stage takes).
            "routes": [route for route, why in self.routes.items() if why is None],
        }
        if Modality.AUDIO in self.graph.modalities:
            try:
                voices = await asyncio.wait_for(self._graph_voices(), 10)
                listed = voices_json(voices, self.graph.voice_aliases)
                card.update(voices=listed["voices"], voice_aliases=listed["aliases"])
            except Exception as err:  # stages not up yet: the card without voices
                logger.info("models: voices not known yet (%s)", type(err).__name__)
        return JSONResponse({"object": "list", "data": [card]})

    @api.get("/v1/audio/voices")
    async def audio_voices(self, request: Request) -> JSONResponse:
        """vLLM-Omni's route: the voices a request may name, plus the graph's aliases."""
        self._check_auth(request)
        self._check_model(None, "/v1/audio/voices")
        return JSONResponse(voices_json(await self._graph_voices(), self.graph.voice_aliases))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()  # vLLM-Omni's stage timings count from the request's arrival
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model, "/v1/chat/completions")
        modalities = self._modalities(body)
        messages = self._chat_messages(body)
        tools = body.tool_calling()
        # A voice the graph does not have is a 400 even when the reply has no audio (as vLLM-Omni refuses it).
        voice = await self._voice(*body.requested_voice())
        omni = self._omni_request(
            request,
            arrived,
            modalities=modalities,
            sampling=self.sampling.for_request(body),
            messages=messages,
            voice=voice if Modality.AUDIO in modalities else None,
            return_prompt_text=bool(body.return_prompt_text),
            tools=tools,
        )
        stream_options = body.stream_options or StreamOptions()
        reply = ChatReply(
            omni.request_id,
            self.graph.served_model_name,
            modalities,
            body.audio.container if body.audio else "wav",
            self.text_stage,
            include_usage=stream_options.include_usage,
            usage_on_every_chunk=stream_options.usage_on_every_chunk,
            prompt_text=omni.return_prompt_text,
            logprobs=bool(body.logprobs),
            stage_log=omni.stage_log,
            stage_metrics=bool(body.return_stage_metrics),
            remember=self.audio_replies.remember,
        )
        return await self.serving.respond(omni, "chat", reply, stream=body.stream)

    @api.post("/v1/audio/transcriptions")
    async def audio_transcriptions(self, request: Request) -> Response:
        """OpenAI's transcription API on a graph whose thinker takes audio: the thinker alone transcribes."""
        self._check_auth(request)
        limit = max(self.graph.max_request_bytes, self.graph.media_input.max_bytes + (64 << 10))
        fields, files = await read_form(request, limit)
        extra = sorted(set(files) - {"file"})  # a file the route does not read is refused, never dropped
        if extra and "file" in files:  # (without 'file', the 400 names the file missing)
            raise bad_request(f"{extra[0]}: unknown file field (this route takes one audio file, 'file')", extra[0])
        try:
            body = TranscriptionRequest.model_validate(fields)
        except ValidationError as err:
            raise from_validation(err) from None
        self._check_model(body.model, "/v1/audio/transcriptions")
        audio, fmt = self._audio_file(files.get("file"))
        omni = self._omni_request(
            request,
            modalities={Modality.TEXT},
            sampling=self.sampling.for_request(SamplingRequest(temperature=body.temperature)),
            messages=transcription_messages(audio, body.language, body.prompt),
        )
        reply = TranscriptionReply(body.response_format, body.stream, self.text_stage, body.language)
        if body.response_format == "verbose_json" and not body.stream:
            reply.duration_s = self._media_check(media_input.audio_seconds, audio.data, fmt, "file")
        streamed = body.stream or body.response_format == "text"
        return await self.serving.respond(omni, "transcriptions", reply, stream=streamed)

    def _audio_file(self, data: bytes | None) -> tuple[MediaPart, str]:
        """The upload as an audio media part: its format sniffed and allowed, its size bounded; not decoded."""
        if data is None:
            raise bad_request("file: an audio file is required (multipart field 'file')", "file")
        limit = self.graph.media_input.max_bytes
        if len(data) > limit:
            message = f"file: audio over the limit of {limit} bytes"
            raise APIError(413, message, type="invalid_request_error", param="file")
        fmt = self._media_check(media_input.check_format, data, "audio", "file")
        return MediaPart(type="audio", param="file", data=data), fmt

    @staticmethod
    def _media_check(check: Any, *args: Any) -> Any:
        try:
            return check(*args)
        except InvalidStageInput as err:
            raise stage_bad_request(err) from None

    @api.websocket("/v1/realtime")
    async def realtime(self, websocket: WebSocket) -> None:
        """OpenAI's Realtime API (:mod:`omni_serve.api.realtime`): a session lives on this replica."""
        timeout = self._serve_timeout_s(websocket.headers)
        serve_limit = None if timeout is None else max(1.0, timeout - DEADLINE_MARGIN_S)
        await serve_session(websocket, self.session_graph, self.api_key, serve_limit)

    @api.post("/v1/audio/speech")
    async def audio_speech(self, request: Request) -> Response:
        body = await self._parse(request, SpeechRequest)
        self._check_model(body.model, "/v1/audio/speech")
        speech = body.speech_fields()
        if self.graph.entry_prompt == "chat":  # a speech-to-speech model speaks its own voices, no TTS voice mode
            for name in TTS_FIELDS:
                if name in speech:
                    raise bad_request(f"{name}: this graph's model speaks in its own voices (not a TTS model)", name)
            # The entry stage teacher-forces the text to speak: nothing of it is sampled.
            if self.graph.entry.name in (body.stage_sampling or {}):
                field = f"stage_sampling.{self.graph.entry.name}"
                raise bad_request(
                    f"{field}: speech teacher-forces this stage's reply (input); it samples nothing", field
                )
        voice = await self._voice(body.voice, "voice")
        messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
        messages.append(ChatMessage(role="user", content=body.input))
        omni = self._omni_request(
            request,
            modalities={Modality.AUDIO},
            sampling=self.sampling.for_request(SamplingRequest(seed=body.seed, stage_sampling=body.stage_sampling)),
            messages=messages,
            voice=voice,
            reply=body.input,
            speech=speech,
        )
        reply = SpeechReply(body.response_format, omni.stage_log, early=body.stream)
        return await self.serving.respond(omni, "speech", reply, stream=True)

    @api.post("/v1/images/generations")
    async def images_generations(self, request: Request) -> Response:
        """OpenAI images API on a graph with an image final output: PNGs as b64_json."""
        body = await self._parse(request, ImageGenerationRequest)
        self._check_model(body.model, "/v1/images/generations")
        omni = self._omni_request(
            request,
            modalities={Modality.IMAGE},
            sampling=self.sampling.defaults(body.seed),
            messages=body.messages(),
            image=body.image_params(),
        )
        return await self.serving.respond(omni, "images", ImagesReply(), stream=False)

    @api.post("/v1/images/edits")
    async def images_edits(self, request: Request) -> Response:
        """OpenAI's image edit (multipart: ``image``, the instruction in ``prompt``) on a graph whose image stage
        takes images. The image is a chat image part by another name: the same formats, byte limit and path
        (by reference to the entry stage, which decodes it; never decoded here)."""
        self._check_auth(request)
        limit = max(self.graph.max_request_bytes, self.graph.media_input.max_bytes + (64 << 10))
        fields, files = await read_form(request, limit)
        try:
            body = ImageEditRequest.model_validate(fields)
        except ValidationError as err:
            raise from_validation(err) from None
        self._check_model(body.model, "/v1/images/edits")
        image = self._image_file(files)
        omni = self._omni_request(
            request,
            modalities={Modality.IMAGE},
            sampling=self.sampling.defaults(body.seed),
            messages=[ChatMessage(role="user", content=[image, TextPart(text=body.prompt)])],
            image=body.image_params(),
        )
        return await self.serving.respond(omni, "images", ImagesReply(), stream=False)

    def _image_file(self, files: dict[str, bytes]) -> MediaPart:
        """The edit's one source image, its format sniffed and allowed, its size bounded; not decoded. A ``mask``
        (OpenAI's inpainting area) is refused: the served edit pipelines edit by instruction, whole."""
        for name in files:
            if name not in ("image", "image[]"):
                if name == "mask":
                    raise bad_request("mask: not supported (this model edits the whole image by the instruction)", name)
                raise bad_request(f"{name}: unknown field", name)
        data = files.get("image", files.get("image[]"))
        if data is None:
            raise bad_request("image: an image file is required (multipart field 'image')", "image")
        if "image" in files and "image[]" in files:
            raise bad_request("image: this model edits one image per request", "image")
        if len(data) > self.graph.media_input.max_bytes:
            message = f"image: over the limit of {self.graph.media_input.max_bytes} bytes"
            raise APIError(413, message, type="invalid_request_error", param="image")
        self._media_check(media_input.check_format, data, "image", "image")
        return MediaPart(type="image", param="image", data=data)

    # ---- /v1/videos: OpenAI's video jobs (omni_serve.api.video_jobs) ------------------------------
    def _video_route(self, request: Request) -> str:
        """Auth first (every route but /health answers 401 without the key, whatever the graph serves), then
        404 on a graph that makes no video (the routes exist only where videos do); whose jobs it sees."""
        client = self._check_auth(request)
        if self.routes["/v1/videos"] is not None:
            raise APIError(404, "Not Found", type="invalid_request_error")
        return owner_of(client, request.headers.get("authorization"))

    def _own_video_jobs(self) -> tuple[str, Any]:
        """(key, handle) of this replica's VideoJobs actor, started on first use (and again once it died).

        No CPU, on this node, owned by this replica's process (it dies with the replica, and with it the
        replica's jobs: the module docstring of omni_serve.api.video_jobs says what that means), named after
        this Serve application and a key of its own, which every job id carries.
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._video_jobs is None:
            context = ray.get_runtime_context()
            self._video_jobs_key = uuid.uuid4().hex
            self._video_jobs = (
                ray.remote(VideoJobs)
                .options(
                    name=actor_name(self.serve_view.app_name, self._video_jobs_key),
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False),
                    max_concurrency=1000,
                )
                .remote(self._video_settings, self._stage_handles)
            )
        return self._video_jobs_key, self._video_jobs

    def _video_jobs_died(self, handle: Any) -> None:
        """This replica's jobs actor ``handle`` no longer answers: the next create starts another (its jobs are
        lost: 404 from every replica, their ids naming an actor that no longer exists)."""
        import ray

        if handle is self._video_jobs:
            logger.warning("video jobs actor %s stopped answering: starting another", self._video_jobs_key)
            self._video_jobs = None
            with contextlib.suppress(Exception):  # unavailable, not dead: its name must not answer for lost jobs
                ray.kill(handle)

    async def _video_jobs_of(self, video_id: str) -> Any:
        """The VideoJobs actor that runs ``video_id``: this replica's, or another's found by name; 404 if none."""
        import ray

        key = actor_key_of(video_id)
        if key is None:
            raise not_found(video_id)
        if self._video_jobs is not None and key == self._video_jobs_key:
            return self._video_jobs
        if key not in self._peer_video_jobs:
            try:
                name = actor_name(self.serve_view.app_name, key)
                self._peer_video_jobs[key] = await asyncio.to_thread(ray.get_actor, name)
            except ValueError:  # no such actor: its replica stopped (or never existed)
                raise not_found(video_id) from None
        return self._peer_video_jobs[key]

    async def _ask_video_jobs(self, video_id: str, method: str, *args: Any) -> Any:
        """One call of the actor that runs ``video_id``; a dead actor (its replica stopped) is a 404."""
        from ray.exceptions import RayActorError

        jobs = await self._video_jobs_of(video_id)
        try:
            return await getattr(jobs, method).remote(video_id, *args)
        except RayActorError:
            self._peer_video_jobs.pop(actor_key_of(video_id) or "", None)
            self._video_jobs_died(jobs)
            raise not_found(video_id) from None

    async def _video_stage_rules(self) -> VideoRules:
        """The video stage's defaults and limits (asked once; a stage that cannot answer fails the request)."""
        if self._video_rules is None:
            stage = next(s.name for s in self.graph.stages if s.final_output is Modality.VIDEO)
            try:
                rules = await self._stage_handles[stage].video_rules.remote()
            except Exception as err:
                raise from_failure(StageFailed(stage, err), "video_rules") from None
            if rules is None:
                raise APIError(500, f"stage '{stage}' makes no video", type="server_error", code="not_a_video_stage")
            self._video_rules = rules
        return self._video_rules

    async def _video_form(self, request: Request) -> VideoCreateRequest:
        """The create body: OpenAI's multipart form (what its client sends), or the same fields as JSON."""
        media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
        if media == "multipart/form-data":
            fields, files = await read_form(request, self.graph.max_request_bytes)
            refuse_files(files)
            data: dict[str, Any] = dict(fields)
        else:
            data = parse_json_object(await read_body(request, self.graph.max_request_bytes))
        try:
            return VideoCreateRequest.model_validate(data)
        except ValidationError as err:
            raise from_validation(err) from None

    @api.post("/v1/videos")
    async def videos_create(self, request: Request) -> JSONResponse:
        """OpenAI's video API: the job answers at once (queued) and runs apart from this request."""
        self._check_auth(request)
        media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
        if media != "multipart/form-data":
            try:
                check_content_type(media)  # the 415 first, as on every POST route
            except APIError:  # naming both bodies this route takes
                message = f"Content-Type must be {VIDEO_BODIES} (got '{media or 'none':.60}')"
                raise APIError(415, message, type="invalid_request_error") from None
        owner = self._video_route(request)
        body = await self._video_form(request)
        self._check_model(body.model, "/v1/videos")
        rules = await self._video_stage_rules()
        params = body.video_params(rules.defaults)
        self._media_check(video_params.check, params, rules)  # 400 naming the field, before any job exists
        omni = self._omni_request(
            request,
            modalities={Modality.VIDEO},
            sampling=self.sampling.defaults(body.seed),
            messages=body.messages(),
            video=params,
        )
        omni.deadline = None  # a job is not bound by this HTTP request's time limit: its own (videos.job_timeout_s)
        job = VideoJob(
            id="",
            owner=owner,
            model=self.graph.served_model_name,
            prompt=body.prompt,
            params=params,
            created_at=int(time.time()),
        )
        return JSONResponse(await self._create_video_job(job, omni))

    async def _create_video_job(self, job: VideoJob, omni: OmniRequest) -> dict[str, Any]:
        """The job created in this replica's actor; an actor found dead is replaced once, then 503 (never a 500)."""
        from ray.exceptions import RayActorError

        for _ in range(2):
            key, jobs = self._own_video_jobs()
            job.id = new_job_id(key)
            try:
                return unpack(await jobs.create.remote(job, omni))["job"]
            except RayActorError:
                self._video_jobs_died(jobs)
        raise APIError(
            503,
            "this server's video jobs are unavailable, retry later",
            type="service_unavailable",
            code="video_jobs_unavailable",
            retry_after_s=5,
        )

    @api.get("/v1/videos/{video_id}")
    async def videos_retrieve(self, video_id: str, request: Request) -> JSONResponse:
        owner = self._video_route(request)
        return JSONResponse(unpack(await self._ask_video_jobs(video_id, "get", owner))["job"])

    @api.delete("/v1/videos/{video_id}")
    async def videos_delete(self, video_id: str, request: Request) -> JSONResponse:
        """Forget the job; a running one's stage call is cancelled, which aborts its engine request."""
        owner = self._video_route(request)
        return JSONResponse(unpack(await self._ask_video_jobs(video_id, "delete", owner))["job"])

    @api.get("/v1/videos/{video_id}/content")
    async def videos_content(self, video_id: str, request: Request) -> Response:
        """The MP4, read from the object store by reference and streamed out (never copied whole here)."""
        import ray

        owner = self._video_route(request)
        variant = request.query_params.get("variant", "video")
        if variant != "video":
            raise bad_request(f"variant: only 'video' is made (got '{variant:.40}')", "variant")
        answer = unpack(await self._ask_video_jobs(video_id, "content", owner))
        [result] = answer["result"]
        video = await result if isinstance(result, ray.ObjectRef) else result  # zero-copy from shared memory
        data = memoryview(video).cast("B")

        async def chunks() -> Any:
            for start in range(0, len(data), 1 << 20):
                yield bytes(data[start : start + (1 << 20)])

        headers = {"content-length": str(len(data)), "content-disposition": f'attachment; filename="{video_id}.mp4"'}
        return StreamingResponse(chunks(), media_type="video/mp4", headers=headers)

    @api.get("/v1/videos")
    async def videos_list(self, request: Request) -> JSONResponse:
        """The caller's jobs on every ingress replica of this application: each replica's VideoJobs actor, found
        by name, gives the positions of its first ``limit`` past ``after``; the page's jobs alone are fetched."""
        owner = self._video_route(request)  # before the query: a client without the key learns nothing of it
        limit, descending, after = list_query(request.query_params)
        cursor = None
        if after is not None:
            try:
                cursor = await self._ask_video_jobs(after, "position", owner)
            except APIError:  # an id that expired, or was never this client's: nothing after it
                cursor = None
            if cursor is None:
                return JSONResponse(video_list([], has_more=False))
        actors = await self._video_actors()
        pages = await asyncio.gather(
            *(actor.page.remote(owner, limit + 1, descending, cursor) for actor in actors.values()),
            return_exceptions=True,
        )
        found = sorted(
            (tuple(position) for page in pages if isinstance(page, list) for position in page), reverse=descending
        )
        shown = [video_id for _, video_id in found[:limit]]
        by_actor: dict[str, list[str]] = {}
        for video_id in shown:
            by_actor.setdefault(actor_key_of(video_id) or "", []).append(video_id)
        fetched: dict[str, dict[str, Any]] = {}
        for key, ids in by_actor.items():
            with contextlib.suppress(Exception):  # an actor that stopped meanwhile: its jobs are gone
                fetched.update((job["id"], job) for job in await actors[key].listed.remote(ids, owner))
        return JSONResponse(video_list([fetched[i] for i in shown if i in fetched], has_more=len(found) > limit))

    async def _video_actors(self) -> dict[str, Any]:
        """Every VideoJobs actor of this Serve application, by key (this replica's included)."""
        import ray

        app = self.serve_view.app_name
        names = await asyncio.to_thread(ray.util.list_named_actors)
        actors: dict[str, Any] = {}
        for key in (k for k in (actor_key_in(name, app) for name in names) if k is not None):
            if self._video_jobs is not None and key == self._video_jobs_key:
                actors[key] = self._video_jobs
            elif key not in self._peer_video_jobs:
                with contextlib.suppress(ValueError):  # stopped meanwhile
                    self._peer_video_jobs[key] = await asyncio.to_thread(ray.get_actor, actor_name(app, key))
            if key in self._peer_video_jobs:
                actors[key] = self._peer_video_jobs[key]
        for gone in set(self._peer_video_jobs) - set(actors):  # their names went with them
            del self._peer_video_jobs[gone]
        return actors
