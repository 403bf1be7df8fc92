"""The ingress deployment: OpenAI-compatible routes, auth and validation in front of the orchestrator.

Every endpoint follows one template: parse + validate the body (400 naming the
field), convert to an :class:`OmniRequest`, run the orchestrator, and either
collect the outputs or stream them. For streams the first output is awaited before
the response starts, so failures that happen early still get a real status code.
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
from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from omni_serve import playground
from omni_serve.config import GraphConfig, load_graph
from omni_serve.errors import APIError, bad_request, from_failure, from_validation, http_exception_handler
from omni_serve.handoff import payload_loads
from omni_serve.media import encode_audio
from omni_serve.metrics import RequestMetrics
from omni_serve.openai import chat, images, speech
from omni_serve.openai.protocol import (
    ChatCompletionRequest,
    api_key_matches,
    check_content_type,
    parse_json_object,
    read_body,
)
from omni_serve.openai.speech import SpeechRequest
from omni_serve.orchestrator import OmniRequest, Orchestrator
from omni_serve.types import ChatMessage, Modality, SamplingParams, StageOutput, StageRequest

logger = logging.getLogger("ray.serve")

Body = TypeVar("Body", bound=BaseModel)

api = FastAPI(title="omni_serve", docs_url=None, redoc_url=None)


@api.exception_handler(APIError)
async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return err.response()


api.add_exception_handler(StarletteHTTPException, http_exception_handler)  # 404/405 as OpenAI errors
playground.mount(api)  # GET / (the playground page) and GET /stages


@serve.deployment(max_ongoing_requests=64, max_queued_requests=256, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class Ingress:
    def __init__(self, graph: dict[str, Any], stages: dict[str, DeploymentHandle]):
        self.graph: GraphConfig = load_graph(graph)
        # By reference: a handoff ObjectRef passed on to the next stage is never
        # materialized here, even if RAY_SERVE_THROUGHPUT_OPTIMIZED flips the default.
        self.handles = {name: h.options(stream=True, _by_reference=True) for name, h in stages.items()}
        self.ready_handles = {name: h.options(method_name="ready") for name, h in stages.items()}
        self.orchestrator = Orchestrator(self.graph, self._call_stage)
        self.api_key = self.graph.api_key or os.environ.get("OMNI_SERVE_API_KEY") or None
        self.metrics = RequestMetrics()
        playground.configure(self.graph, self._check_auth)

    def _call_stage(self, stage: str, request: StageRequest) -> AsyncIterator[StageOutput]:
        return self.handles[stage].generate.remote(request)

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

    # ---- not HTTP: handle methods for tests and operators -------------------------------------
    def payload_loads(self) -> dict[str, int]:
        """How many handoff payloads this process deserialized (the invariant says: none)."""
        return payload_loads()

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

    def _sampling(self, body: ChatCompletionRequest) -> dict[str, SamplingParams]:
        entry = self.graph.entry.name
        overrides = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "max_tokens": body.max_completion_tokens or body.max_tokens,
            "seed": body.seed,
            "repetition_penalty": body.repetition_penalty,
            "stop": body.stop_list or None,
        }
        entry_overrides = {k: v for k, v in overrides.items() if v is not None}
        per_stage = body.stage_sampling or {}
        unknown = sorted(set(per_stage) - {s.name for s in self.graph.stages})
        if unknown:
            raise bad_request(f"stage_sampling: unknown stage '{unknown[0]}'", "stage_sampling")
        resolved: dict[str, SamplingParams] = {}
        for stage in self.graph.stages:
            values = stage.default_sampling.model_dump()
            if stage.name == entry:
                values.update(entry_overrides)
            elif body.seed is not None:
                values["seed"] = body.seed  # one client seed makes every stage reproducible
            values.update(per_stage.get(stage.name, {}))
            try:
                resolved[stage.name] = SamplingParams.model_validate(values)
            except ValidationError as err:
                api_err = from_validation(err)
                api_err.param = f"stage_sampling.{stage.name}.{api_err.param}"
                api_err.message = f"stage_sampling.{stage.name}.{api_err.message}"
                raise api_err from None
        return resolved

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
        async def probe(name: str) -> tuple[str, bool]:
            try:
                return name, bool(await asyncio.wait_for(self.ready_handles[name].remote(), 10))
            except Exception:
                return name, False

        results = dict(await asyncio.gather(*(probe(n) for n in self.ready_handles)))
        ok = all(results.values())
        return JSONResponse(
            {
                "status": "ok" if ok else "unavailable",
                "stages": {n: "ready" if r else "down" for n, r in results.items()},
            },
            status_code=200 if ok else 503,
        )

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._check_auth(request)
        card = {
            "id": self.graph.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "omni_serve",
            "modalities": sorted(m.value for m in self.graph.modalities),
            "stages": [s.name for s in self.graph.stages],
        }
        return JSONResponse({"object": "list", "data": [card]})

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        modalities = self._modalities(body)
        try:
            messages = [ChatMessage(role=m.role, content=m.text()) for m in body.messages]
        except ValueError as err:
            index = next(i for i, m in enumerate(body.messages) if not isinstance(m.content, str))
            raise bad_request(f"messages.{index}.{err}", f"messages.{index}.content") from None
        audio = body.audio
        omni = OmniRequest(
            request_id=request_id,
            modalities=modalities,
            sampling=self._sampling(body),
            messages=messages,
            voice=audio.voice if audio else None,
        )
        audio_format = audio.format if audio else "wav"
        created = int(time.time())
        model = self.graph.served_model_name
        headers = {"x-request-id": request_id}
        text_stage = self.graph.entry.name
        outputs = aiter(self._observed(omni, "chat"))
        try:
            first = await anext(outputs, None)
            if not body.stream:
                result = chat.ChatResult()
                item = first
                while item is not None:
                    result.add(item, item.stage == text_stage)
                    item = await anext(outputs, None)
                return JSONResponse(
                    chat.completion(request_id, model, created, result, modalities, audio_format), headers=headers
                )
        except APIError:
            raise
        except Exception as err:
            raise from_failure(err, request_id) from None
        finally:
            if not body.stream:
                await outputs.aclose()

        async def events() -> AsyncIterator[str]:
            result = chat.ChatResult()
            item = first
            try:
                yield chat.sse(chat.chunk(request_id, model, created, {"role": "assistant", "content": ""}))
                while item is not None:
                    result.add(item, item.stage == text_stage)
                    if item.text and Modality.TEXT in modalities:
                        delta = {"content": item.text}
                        yield chat.sse(chat.chunk(request_id, model, created, delta, modality=Modality.TEXT))
                    if item.audio is not None:
                        delta = chat.audio_delta(request_id, item, audio_format)
                        yield chat.sse(chat.chunk(request_id, model, created, delta, modality=Modality.AUDIO))
                    if item.images:  # content parts, as in the non-streamed message
                        delta = {"content": images.content_parts(item.images)}
                        yield chat.sse(chat.chunk(request_id, model, created, delta, modality=Modality.IMAGE))
                    item = await anext(outputs, None)
            except Exception as err:
                # Headers are gone: report in-band and do not send [DONE], so nobody takes it for success.
                error = from_failure(err, request_id)
                yield chat.sse({"error": {"message": error.message, "type": error.type, "code": error.status}})
                return
            finally:
                await outputs.aclose()
            yield chat.sse(chat.chunk(request_id, model, created, {}, finish_reason=result.finish_reason))
            if body.stream_options and body.stream_options.include_usage:
                yield chat.sse(chat.usage_chunk(request_id, model, created, result.usage))
            yield chat.sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @api.post("/v1/audio/speech")
    async def audio_speech(self, request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        body = await self._parse(request, SpeechRequest)
        self._check_model(body.model)
        if Modality.AUDIO not in self.graph.modalities:
            raise bad_request(f"model '{self.graph.served_model_name}' does not produce audio", "model")
        messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
        messages.append(ChatMessage(role="user", content=body.input))
        omni = OmniRequest(
            request_id=request_id,
            modalities={Modality.AUDIO},
            sampling={s.name: s.default_sampling for s in self.graph.stages},
            messages=messages,
            voice=body.voice,
            reply=body.input,
        )
        outputs = aiter(self._observed(omni, "speech"))
        try:  # the first chunk decides the status code
            first = await anext(outputs, None)
        except Exception as err:
            await outputs.aclose()
            raise from_failure(err, request_id) from None
        fmt = body.response_format

        async def audio() -> AsyncIterator[bytes]:
            item, chunks = first, []
            try:
                if fmt == "wav":
                    yield speech.wav_stream_header(first.sample_rate if first and first.sample_rate else 24000)
                while item is not None:
                    if item.audio is not None:
                        if fmt == "flac":
                            chunks.append(item.audio)
                        else:
                            yield speech.pcm16(item.audio)
                    item = await anext(outputs, None)
            except Exception as err:
                # The status line is sent: cut the body short, which a client sees as a broken
                # transfer rather than a complete file.
                from_failure(err, request_id)
                raise
            finally:
                await outputs.aclose()
            if fmt == "flac":
                samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
                yield encode_audio(samples, first.sample_rate if first and first.sample_rate else 24000, "flac")

        headers = {"x-request-id": request_id}
        return StreamingResponse(audio(), media_type=speech.MEDIA_TYPES[fmt], headers=headers)

    @api.post("/v1/images/generations")
    async def images_generations(self, request: Request) -> JSONResponse:
        """OpenAI images API on a graph with an image final output: PNGs as b64_json."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        body = await self._parse(request, images.ImageGenerationRequest)
        self._check_model(body.model)
        if Modality.IMAGE not in self.graph.modalities:
            raise bad_request(f"model '{self.graph.served_model_name}' does not generate images", "model")
        sampling = {s.name: s.default_sampling for s in self.graph.stages}
        if body.seed is not None:
            sampling = {name: params.model_copy(update={"seed": body.seed}) for name, params in sampling.items()}
        omni = OmniRequest(
            request_id=request_id,
            modalities={Modality.IMAGE},
            sampling=sampling,
            messages=body.messages(),
            image=body.image_params(),
        )
        generated = []
        outputs = self._observed(omni, "images")
        try:
            async for output in outputs:
                generated.extend(output.images)
        except Exception as err:
            raise images.name_stage_field(from_failure(err, request_id)) from None
        finally:
            await outputs.aclose()
        body_json = images.generation_response(int(time.time()), generated)
        return JSONResponse(body_json, headers={"x-request-id": request_id})
