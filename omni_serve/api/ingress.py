"""The ingress deployment: OpenAI-compatible routes, auth and validation in front of the orchestrator.

Every endpoint follows one template: parse + validate the body (400 naming the
field, the voice included, before any stage runs), convert to an :class:`OmniRequest`,
run the orchestrator, and either collect the outputs or stream them. For streams the
first output is awaited before the response starts, so failures that happen early still
get a real status code; a failure after that is sent in-band as the same error object.
Every failure goes through one ladder, :func:`omni_serve.api.errors.from_failure`.

Request ids: the server mints one per request (the response's ``id``); the client's
``X-Request-ID`` is a label for logs (Serve's proxy echoes it in the response header, or
its own id when the client sent none) and never reaches an engine: the orchestrator
derives each stage call's engine id from the server's id.
"""

# No `from __future__ import annotations`: FastAPI resolves route annotations at runtime and the
# ingress class travels to its replica by value, where string annotations no longer resolve.

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import numpy as np
import ray
from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve._private.http_util import parse_request_timeout_header
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from omni_serve.api import playground
from omni_serve.api.errors import (
    APIError,
    bad_request,
    from_failure,
    from_validation,
    http_exception_handler,
    stage_bad_request,
)
from omni_serve.api.openai import chat, images
from omni_serve.api.openai.protocol import (
    ChatCompletionRequest,
    MediaRules,
    api_key_matches,
    check_content_type,
    parse_json_object,
    read_body,
    sampling_overrides,
)
from omni_serve.api.openai.speech import SpeechRequest
from omni_serve.api.openai.voices import resolve_voice, voices_json
from omni_serve.engines import honoured_sampling, unhonoured_sampling
from omni_serve.graph.config import DEADLINE_MARGIN_S, GraphConfig, check_timeouts, load_graph
from omni_serve.graph.metrics import RequestMetrics
from omni_serve.graph.orchestrator import OmniRequest, Orchestrator, StageFailed
from omni_serve.graph.readiness import ServeView
from omni_serve.graph.stage import Stage
from omni_serve.graph.transport import stage_outputs
from omni_serve.media import inputs as media_input
from omni_serve.media.encode import (
    AUDIO_MEDIA_TYPES,
    EMPTY_AUDIO_SAMPLE_RATE,
    STREAMABLE_AUDIO,
    AudioEncoder,
    encode_audio,
)
from omni_serve.payload import payload_loads
from omni_serve.types import ChatMessage, InvalidStageInput, Modality, SamplingParams, StageOutput, StageRequest

logger = logging.getLogger("ray.serve")

Body = TypeVar("Body", bound=BaseModel)

api = FastAPI(title="omni_serve", docs_url=None, redoc_url=None)


@api.exception_handler(APIError)
async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return err.response()


api.add_exception_handler(StarletteHTTPException, http_exception_handler)  # 404/405 as OpenAI errors
playground.mount(api)  # GET / (the playground page) and GET /stages


class ServeStreamingResponse(StreamingResponse):
    """Starlette's streaming response, sent the way it sends to ASGI 2.4 servers: no disconnect listener.

    Behind an ASGI < 2.4 server Starlette runs the body in an anyio task group next to a task that
    waits for ``http.disconnect``, and cancels the group at the end; anyio builds the current task's
    repr for that cancel, reading source files (~9% of the ingress's CPU at 8 concurrent streams,
    py-spy). Under Serve the listener is redundant: when the client leaves, Serve cancels the ingress's
    call (its proxy, or the replica's own HTTP server behind HAProxy), which cancels this response and
    the orchestrator's stage calls (``tests/test_cancellation.py``, ``tests/test_haproxy_ingress.py``).
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__({**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}, receive, send)


@serve.deployment(max_ongoing_requests=64, max_queued_requests=256, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Ingress:
    async def __init__(
        self, graph: dict[str, Any], stages: dict[str, DeploymentHandle], media: dict[str, Any] | None = None
    ):
        self.graph: GraphConfig = load_graph(graph)
        # By reference: a handoff ObjectRef passed on to the next stage is never
        # materialized here, even if RAY_SERVE_THROUGHPUT_OPTIMIZED flips the default.
        self.handles = {name: h.options(stream=True, _by_reference=True) for name, h in stages.items()}
        self.voice_handles = {name: h.options(method_name="voices") for name, h in stages.items()}
        self.orchestrator = Orchestrator(self.graph, self._call_stage)
        self.api_key = self.graph.api_key or os.environ.get("OMNI_SERVE_API_KEY") or None
        self.metrics = RequestMetrics()
        self.serve_view = ServeView(
            serve.get_replica_context().app_name, {s.name: self.graph.deployment(s.name) for s in self.graph.stages}
        )
        # Serve's own limit; the ingress answers 504 before it (see check_timeouts).
        self.request_timeout_s = self.serve_view.request_timeout_s()
        check_timeouts(self.graph.stage_timeout_s, self.request_timeout_s)
        self.honoured_sampling = {s.name: honoured_sampling(s.engine, s.engine_args) for s in self.graph.stages}
        self.text_stage = next((s.name for s in self.graph.stages if s.final_output is Modality.TEXT), None)
        self.media_rules = MediaRules(
            frozenset(m.value for m in self.graph.input_modalities), self.graph.media_policy, self.graph.media_input
        )
        self._voices: list[str] | None = None  # asked from the stages once, on first need
        # engine_in_ingress: the graph's one stage runs here, called in process (no handle, no Ray objects).
        self.local: Stage | None = None
        if self.graph.engine_in_ingress:
            self.local = Stage(self.graph.entry.model_dump(mode="json"), media)
            await self.local.start()
        playground.configure(self.graph, self._check_auth, self.serve_view)

    def _call_stage(self, stage: str, request: StageRequest) -> AsyncIterator[StageOutput]:
        if self.local is not None:
            return self.local.generate(request)  # one stage: no handoff to own
        # Handoffs arrive as stream items this replica owns: they live as long as this request needs them.
        return stage_outputs(self.handles[stage].generate.remote(request), request)

    async def _observed(self, omni: OmniRequest, route: str) -> AsyncIterator[StageOutput]:
        """The orchestrator's outputs for one request, timed for the request metrics."""
        timer = self.metrics.timer(route)
        status = 499  # the client left before the end
        try:
            async for item in self.orchestrator.run(omni):
                timer.saw(item)
                yield item
            status = 200
        except Exception as err:
            status = from_failure(err, omni.request_id, log=False).status
            raise
        finally:
            timer.done(status)

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
        if getattr(self, "local", None) is not None:
            self.local.shutdown()  # Serve calls __del__ when the replica stops

    # ---- not HTTP: handle methods for tests and operators -------------------------------------
    def payload_loads(self) -> dict[str, int]:
        """How many handoff payloads this process deserialized (the invariant says: none)."""
        return payload_loads()

    def media_decodes(self) -> dict[str, int]:
        """How many media items this process decoded (the invariant says: none; the entry stage decodes)."""
        return media_input.decodes()

    # ---- the shared template -------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        if not api_key_matches(request.headers.get("authorization"), self.api_key):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer ...)", type="authentication_error")

    async def _parse(self, request: Request, model: type[Body]) -> Body:
        self._check_auth(request)
        check_content_type(request.headers.get("content-type"))
        data = parse_json_object(await read_body(request, self.graph.max_request_bytes))
        try:
            return model.model_validate(data)
        except ValidationError as err:
            raise from_validation(err) from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.graph.served_model_name:
            raise APIError(
                404,
                f"model '{model}' does not exist; this server serves '{self.graph.served_model_name}'",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def _omni_request(self, request: Request, **fields: Any) -> OmniRequest:
        """The internal request with its server-minted id and its deadline."""
        client_id = request.headers.get("x-request-id") or None
        return OmniRequest(
            request_id=uuid.uuid4().hex, client_request_id=client_id, deadline=self._deadline(request), **fields
        )

    def _deadline(self, request: Request) -> float | None:
        """Serve's limit for this request (its header override included), less a margin, as a monotonic time."""
        headers = {k.encode("latin-1"): v.encode("latin-1") for k, v in request.headers.items()}
        timeout = parse_request_timeout_header(headers, self.request_timeout_s)
        return None if timeout is None else time.monotonic() + max(0.0, timeout - DEADLINE_MARGIN_S)

    async def _graph_voices(self) -> list[str]:
        """The voices the graph's stages declare (asked once; the graph's stages never change under an ingress).

        A stage that cannot answer fails the request like any stage call (e.g. 503 naming it).
        """
        if self._voices is None:

            async def ask(stage: str) -> list[str]:
                try:
                    if self.local is not None:
                        return self.local.voices()
                    return await self.voice_handles[stage].remote()
                except Exception as err:
                    raise from_failure(StageFailed(stage, err), "voices") from None

            declared = await asyncio.gather(*(ask(s.name) for s in self.graph.stages))
            self._voices = sorted({voice.lower() for voices in declared for voice in voices})
        return self._voices

    async def _voice(self, requested: str | None, param: str) -> str | None:
        if requested is None:
            return None
        return resolve_voice(requested, await self._graph_voices(), self.graph.voice_aliases, param)

    def _sampling(self, body: ChatCompletionRequest) -> dict[str, SamplingParams]:
        """Graph defaults, then the top-level fields (entry stage; ``seed`` everywhere), then per-stage overrides:
        ``stage_sampling`` by stage name or vLLM-Omni's ``sampling_params_list`` by stage position.

        A value the stage's engine cannot honour (one of vLLM's extra sampling parameters, away
        from its default) is a 400 naming the field as the client sent it."""
        entry = self.graph.entry.name
        top_level = body.entry_sampling()
        per_stage, where = self._per_stage(body)
        resolved: dict[str, SamplingParams] = {}
        for stage in self.graph.stages:
            values = stage.default_sampling.model_dump()
            sent_as: dict[str, str] = {}  # field -> the prefix of its path in the request
            if stage.name == entry:
                values.update(top_level)
                sent_as.update(dict.fromkeys(top_level, ""))
            elif body.seed is not None:
                values["seed"] = body.seed  # one client seed makes every stage reproducible
            overrides = sampling_overrides(per_stage.get(stage.name, {}))
            values.update(overrides)
            sent_as.update(dict.fromkeys(overrides, f"{where[stage.name]}."))
            try:
                resolved[stage.name] = params = SamplingParams.model_validate(values)
            except ValidationError as err:
                api_err = from_validation(err)
                prefix = sent_as.get((api_err.param or "").split(".")[0], f"{where[stage.name]}.")
                api_err.param = f"{prefix}{api_err.param}"
                api_err.message = f"{prefix}{api_err.message}"
                raise api_err from None
            for name in unhonoured_sampling(params, self.honoured_sampling[stage.name]):
                param = f"{sent_as.get(name, '')}{name}"
                raise bad_request(
                    f"{param}: stage '{stage.name}' ({stage.engine} engine) cannot honour {name}; leave it at "
                    f"{SamplingParams.model_fields[name].get_default(call_default_factory=True)!r}",
                    param,
                )
        return resolved

    def _per_stage(self, body: ChatCompletionRequest) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Per-stage overrides by stage name, and the field path each came from (for error messages)."""
        names = [s.name for s in self.graph.stages]
        if body.sampling_params_list is not None:
            if len(body.sampling_params_list) > len(names):
                raise bad_request(
                    f"sampling_params_list: {len(body.sampling_params_list)} entries, but the graph has "
                    f"{len(names)} stages {names} (one entry per stage, in this order)",
                    "sampling_params_list",
                )
            return dict(zip(names, body.sampling_params_list, strict=False)), {
                name: f"sampling_params_list.{i}" for i, name in enumerate(names)
            }
        per_stage = body.stage_sampling or {}
        unknown = sorted(set(per_stage) - set(names))
        if unknown:
            raise bad_request(f"stage_sampling: unknown stage '{unknown[0]}'", "stage_sampling")
        return per_stage, {name: f"stage_sampling.{name}" for name in names}

    def _seeded_defaults(self, seed: int | None) -> dict[str, SamplingParams]:
        """Every stage's default sampling, with the client's seed (if any) in each."""
        defaults = {s.name: s.default_sampling for s in self.graph.stages}
        if seed is None:
            return defaults
        return {name: params.model_copy(update={"seed": seed}) for name, params in defaults.items()}

    def _chat_messages(self, body: ChatCompletionRequest) -> list[ChatMessage]:
        """The request's turns; media checked cheaply here and sent on by reference (never decoded here):
        the bytes of data URLs go into the object store, and the entry stage fetches and decodes (in this
        process with ``engine_in_ingress``: then the bytes stay where they are)."""
        try:
            messages = body.chat_messages(self.media_rules)
        except InvalidStageInput as err:
            raise stage_bad_request(err) from None
        for part in (p for m in messages for p in m.media()):
            if part.data is not None and self.local is None:
                part.data = ray.put(part.data)
        return messages

    def _modalities(self, body: ChatCompletionRequest) -> set[Modality]:
        wanted = set(body.modalities or [Modality.TEXT])
        missing = wanted - self.graph.modalities
        if missing:
            names = ", ".join(sorted(m.value for m in missing))
            offered = sorted(m.value for m in self.graph.modalities)
            raise bad_request(f"modalities: this graph cannot produce {names} (it offers {offered})", "modalities")
        return wanted

    # ---- routes --------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 when every stage has a running replica; 503 naming the stages loading or down.

        Asks Serve's controller (:mod:`omni_serve.graph.readiness`), so a saturated graph answers at once.
        """
        states = await self.serve_view.stage_states()
        ok = all(state == "ready" for state in states.values())
        body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "stages": states}
        if not ok:
            waiting = {state: [n for n, s in states.items() if s == state] for state in set(states.values())}
            body["message"] = "; ".join(
                f"{state}: {', '.join(n)}" for state, n in sorted(waiting.items()) if state != "ready"
            )
        return JSONResponse(body, status_code=200 if ok else 503)

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
        return JSONResponse(voices_json(await self._graph_voices(), self.graph.voice_aliases))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        modalities = self._modalities(body)
        messages = self._chat_messages(body)
        voice = await self._voice(*body.requested_voice()) if Modality.AUDIO in modalities else None
        omni = self._omni_request(
            request,
            modalities=modalities,
            sampling=self._sampling(body),
            messages=messages,
            voice=voice,
            return_prompt_text=bool(body.return_prompt_text),
        )
        request_id = omni.request_id
        audio_format = body.audio.container if body.audio else "wav"
        created = int(time.time())
        model = self.graph.served_model_name
        outputs = aiter(self._observed(omni, "chat"))
        try:
            first = await anext(outputs, None)
            if not body.stream:
                result = chat.ChatResult(self.text_stage)
                item = first
                while item is not None:
                    result.add(item)
                    item = await anext(outputs, None)
                completion = chat.completion(
                    request_id, model, created, result, modalities, audio_format, prompt_text=omni.return_prompt_text
                )
                return JSONResponse(completion)
        except APIError:
            raise
        except Exception as err:
            raise from_failure(err, request_id) from None
        finally:
            if not body.stream:
                await outputs.aclose()

        async def events() -> AsyncIterator[str]:
            result = chat.ChatResult(self.text_stage)
            item = first
            try:
                opening = chat.chunk(request_id, model, created, {"role": "assistant", "content": ""})
                if omni.return_prompt_text:  # vLLM's field, on the first chunk only
                    opening["prompt_text"] = first.prompt_text if first else None
                yield chat.sse(opening)
                while item is not None:
                    result.add(item)
                    if item.text and Modality.TEXT in modalities:
                        delta = {"content": item.text}
                        yield chat.sse(chat.chunk(request_id, model, created, delta, modality=Modality.TEXT))
                    elif item.text and Modality.AUDIO in modalities:  # audio only: the text is its transcript
                        delta = chat.transcript_delta(request_id, item.text)
                        yield chat.sse(chat.chunk(request_id, model, created, delta, modality=Modality.AUDIO))
                    if item.audio is not None:
                        delta = chat.audio_delta(request_id, item, audio_format)
                        yield chat.sse(chat.chunk(request_id, model, created, delta, modality=Modality.AUDIO))
                    if item.images:  # content parts, as in the non-streamed message
                        delta = {"content": images.content_parts(item.images)}
                        yield chat.sse(chat.chunk(request_id, model, created, delta, modality=Modality.IMAGE))
                    item = await anext(outputs, None)
            except Exception as err:
                # Headers are gone: report in-band (the same error object as a JSON error) and do not
                # send [DONE], so nobody takes the truncated stream for success.
                yield chat.sse(from_failure(err, request_id).body())
                return
            finally:
                await outputs.aclose()
            yield chat.sse(chat.chunk(request_id, model, created, {}, finish_reason=result.finish_reason))
            if body.stream_options and body.stream_options.include_usage:
                yield chat.sse(chat.usage_chunk(request_id, model, created, result.usage))
            yield chat.sse("[DONE]")

        return ServeStreamingResponse(events(), media_type="text/event-stream")

    @api.post("/v1/audio/speech")
    async def audio_speech(self, request: Request) -> Response:
        body = await self._parse(request, SpeechRequest)
        self._check_model(body.model)
        if Modality.AUDIO not in self.graph.modalities:
            raise bad_request(f"model '{self.graph.served_model_name}' does not produce audio", "model")
        voice = await self._voice(body.voice, "voice")
        messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
        messages.append(ChatMessage(role="user", content=body.input))
        omni = self._omni_request(
            request,
            modalities={Modality.AUDIO},
            sampling=self._seeded_defaults(body.seed),
            messages=messages,
            voice=voice,
            reply=body.input,
        )
        outputs = aiter(self._observed(omni, "speech"))
        try:  # the first audio chunk (or the end) decides the status code
            first = await anext(outputs, None)
            while first is not None and first.audio is None:
                first = await anext(outputs, None)
        except Exception as err:
            await outputs.aclose()
            raise from_failure(err, omni.request_id) from None
        fmt = body.response_format

        async def audio() -> AsyncIterator[bytes]:
            item, whole = first, []
            encoder: AudioEncoder | None = None
            rate = first.sample_rate if first is not None and first.sample_rate else EMPTY_AUDIO_SAMPLE_RATE
            try:
                if fmt in STREAMABLE_AUDIO:
                    encoder = AudioEncoder(fmt, rate)
                while item is not None:
                    if item.audio is not None and encoder is not None:
                        if data := encoder.encode(item.audio):
                            yield data
                    elif item.audio is not None:
                        whole.append(item.audio)
                    item = await anext(outputs, None)
            except Exception as err:
                # The status line is sent: cut the body short, which a client sees as a broken
                # transfer rather than a complete file.
                from_failure(err, omni.request_id)
                raise
            finally:
                await outputs.aclose()
            if encoder is not None:
                yield encoder.finish()
            else:
                yield encode_audio(np.concatenate(whole) if whole else np.zeros(0, np.float32), rate, fmt)

        return ServeStreamingResponse(audio(), media_type=AUDIO_MEDIA_TYPES[fmt])

    @api.post("/v1/images/generations")
    async def images_generations(self, request: Request) -> JSONResponse:
        """OpenAI images API on a graph with an image final output: PNGs as b64_json."""
        body = await self._parse(request, images.ImageGenerationRequest)
        self._check_model(body.model)
        if Modality.IMAGE not in self.graph.modalities:
            raise bad_request(f"model '{self.graph.served_model_name}' does not generate images", "model")
        omni = self._omni_request(
            request,
            modalities={Modality.IMAGE},
            sampling=self._seeded_defaults(body.seed),
            messages=body.messages(),
            image=body.image_params(),
        )
        generated = []
        outputs = self._observed(omni, "images")
        try:
            async for output in outputs:
                generated.extend(output.images)
        except Exception as err:
            raise from_failure(err, omni.request_id) from None
        finally:
            await outputs.aclose()
        return JSONResponse(images.generation_response(int(time.time()), generated))
