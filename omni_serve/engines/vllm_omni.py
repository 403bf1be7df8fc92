"""The ``vllm_omni`` engine family: one vLLM-Omni 0.30 stage engine per Serve replica (GPU production path).

vLLM-Omni normally runs every stage of a model under one orchestrator. Here a
replica builds exactly one stage's engine the way vLLM-Omni's ``StageRuntime``
builds each of its stages (``_build_logical_stage_init_plans`` +
``_initialize_local_llm_replica``):

1. the stage config in vLLM-Omni's (legacy, production) per-stage shape, from
   this stage's ``engine_args`` (see :func:`stage_config`);
2. ``stage_init_utils.build_engine_args_dict`` -> ``build_vllm_config`` ->
   ``(VllmConfig, executor class)``; the stage's worker (``ar``/``generation``)
   and scheduler classes come from its engine args;
3. ``stage_engine_startup.launch_stage_replica`` spawns the stage's EngineCore
   process (``StageEngineCoreProcManager``) and
   ``StageEngineCoreClientBase.make_async_mp_client`` attaches the async client;
4. vLLM-Omni's ``MultimodalOutputProcessor`` turns engine outputs into
   ``RequestOutput``s with the stage's multimodal output (hidden states, codec
   codes, audio) attached; one background task pumps them, as vLLM's ``AsyncLLM``.

Handoffs reuse vLLM-Omni's stage input processors (see
:mod:`omni_serve.models.vllm_omni_handoffs`). GPUs come from Ray (never
``devices``); tensor parallel runs inside the replica with the ``mp`` executor.
Only the pydantic ``EngineArgs`` is imported at graph validation time; vLLM and
vLLM-Omni are imported in :meth:`VllmOmniEngine.start`, ``vllm_omni`` first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.engines.base import StageEngine
from omni_serve.media.inputs import Audio, Decoded, Video
from omni_serve.models import qwen3_omni
from omni_serve.models import vllm_omni_handoffs as handoffs
from omni_serve.payload import HandoffPayload
from omni_serve.types import (
    EngineError,
    FinishReason,
    InvalidStageInput,
    Modality,
    SamplingParams,
    StageOutput,
    StageRequest,
    Usage,
)

logger = logging.getLogger("ray.serve")


class CodecChunkArgs(BaseModel):
    """Codec streaming talker -> code2wav, as vLLM-Omni's async-chunk connector does it."""

    model_config = ConfigDict(extra="forbid")

    chunk_frames: int = Field(25, ge=1, description="Frames per codec chunk.")
    left_context_frames: int = Field(25, ge=0, description="Frames of left context each chunk carries.")
    initial_chunk_frames: int = Field(0, ge=0, description="Smaller first chunk (0 = same size), cuts time to audio.")


class EngineArgs(BaseModel):
    """One vLLM-Omni stage. ``engine`` is passed to vLLM-Omni's engine-args builder as is."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="HF model id or local path of the whole omni checkpoint; 'tiny' is omni_serve's tiny Qwen3-Omni."
    )
    pipeline: Literal["qwen3_omni_moe", "qwen2_5_omni"] = Field(
        description="vLLM-Omni pipeline model_type; picks the stage input processors."
    )
    stage_id: int = Field(ge=0, description="This stage's id in the vLLM-Omni pipeline.")
    model_stage: Literal["thinker", "talker", "code2wav"] = Field(description="vLLM-Omni model_stage.")
    engine_input_source: list[int] = Field(default_factory=list, description="Upstream stage ids (topology).")
    final_output_type: Literal["text", "audio"] | None = Field(None, description="What a final stage emits.")
    is_comprehension: bool = Field(False, description="Stage owns the tokenizer (thinker).")
    requires_multimodal_data: bool = Field(False, description="Stage consumes multimodal inputs.")
    custom_process_input_func: str | None = Field(None, description="vLLM-Omni consumer-side processor path.")
    sampling_constraints: dict[str, Any] = Field(
        default_factory=dict, description="Sampling fields forced on every request (e.g. the talker's stop token)."
    )
    codec_chunk: CodecChunkArgs | None = Field(None, description="Talker only: stream codec chunks to code2wav.")
    engine: dict[str, Any] = Field(
        default_factory=dict, description="vLLM-Omni stage engine args (OmniEngineArgs fields, worker/scheduler)."
    )

    @model_validator(mode="after")
    def _check(self) -> EngineArgs:
        for key in ("devices", "model", "model_stage"):
            if key in self.engine:
                why = "Ray assigns GPUs to the replica" if key == "devices" else f"use engine_args.{key}"
                raise ValueError(f"engine.{key} is not allowed: {why}")
        tp = int(self.engine.get("tensor_parallel_size") or 1)
        if tp > 1 and self.engine.get("distributed_executor_backend") != "mp":
            raise ValueError(
                f"engine.distributed_executor_backend: tensor_parallel_size={tp} inside a Serve replica needs 'mp' "
                "(the Ray executor loses the replica's placement group)"
            )
        if self.codec_chunk is not None and (self.model_stage != "talker" or self.pipeline != "qwen3_omni_moe"):
            raise ValueError("codec_chunk: only the qwen3_omni_moe talker streams codec chunks")
        return self


def create(stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    return VllmOmniEngine(stage_name, engine_args)


def input_modalities(args: EngineArgs) -> set[Modality]:
    """Both pipelines' thinkers take images, audio and video; the other stages take no chat."""
    return {Modality.TEXT, Modality.IMAGE, Modality.AUDIO, Modality.VIDEO} if args.model_stage == "thinker" else set()


# ---------------------------------------------------------------------------
# Pure pieces (tested on CPU)
# ---------------------------------------------------------------------------


def stage_config(args: EngineArgs) -> dict[str, Any]:
    """This stage in vLLM-Omni's per-stage config shape (what ``StageConfig.to_omegaconf`` yields)."""
    final = args.final_output_type is not None
    return {
        "stage_id": args.stage_id,
        "stage_type": "llm",
        "engine_args": {**args.engine, "model_stage": args.model_stage, "final_output": final},
        "runtime": {"process": True, "requires_multimodal_data": args.requires_multimodal_data},
        "engine_input_source": list(args.engine_input_source),
        "final_output": final,
        "final_output_type": args.final_output_type,
        "is_comprehension": args.is_comprehension,
        "sampling_constraints": dict(args.sampling_constraints),
        "default_sampling_params": {},
        **({"custom_process_input_func": args.custom_process_input_func} if args.custom_process_input_func else {}),
    }


def vllm_sampling_params(sampling: SamplingParams, constraints: Mapping[str, Any], output_kind: Any) -> Any:
    """vLLM ``SamplingParams`` from omni_serve's, with the stage's constraints merged as vLLM-Omni does."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm_omni.config.stage_config import merge_sampling_constraints

    values = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # 0 disables top-k in vLLM as it does here
        "max_tokens": sampling.max_tokens,
        "repetition_penalty": sampling.repetition_penalty,
        "seed": sampling.seed,
        "stop": list(sampling.stop) or None,
        "stop_token_ids": list(sampling.stop_token_ids),
    }
    merged = merge_sampling_constraints(values, constraints)
    return VllmSamplingParams(**merged, output_kind=output_kind)


def multimodal_output(output: Any) -> dict[str, Any]:
    """The multimodal payload vLLM-Omni attached to a ``RequestOutput`` (request- or completion-level)."""
    for owner in (output, *(getattr(output, "outputs", None) or [])[:1]):
        value = getattr(owner, "multimodal_output", None)
        if isinstance(value, Mapping) and value:
            return dict(value)
    return {}


def _lookup(mm: Mapping[str, Any], dotted: str) -> Any:
    if dotted in mm:
        return mm[dotted]
    outer, _, inner = dotted.partition(".")
    nested = mm.get(outer)
    return nested.get(inner) if isinstance(nested, Mapping) else None


def _tensor(value: Any) -> Any:
    """One CPU tensor from a tensor or a list of per-step tensors."""
    import torch

    if isinstance(value, (list, tuple)):
        parts = [v for v in value if isinstance(v, torch.Tensor)]
        if not parts:
            return None
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return value.detach().cpu() if isinstance(value, torch.Tensor) else None


def audio_samples(mm: Mapping[str, Any]) -> tuple[np.ndarray, int]:
    """(float32 mono samples, sample rate) of a code2wav output."""
    import torch

    audio = _tensor(mm.get("audio", mm.get("model_outputs")))
    if audio is None:
        raise EngineError(f"code2wav output has no audio (keys: {sorted(mm)})")
    rate = mm.get("sr", qwen3_omni.SAMPLE_RATE)
    if isinstance(rate, (list, tuple)):
        rate = rate[-1] if rate else qwen3_omni.SAMPLE_RATE
    if isinstance(rate, torch.Tensor):
        rate = rate.reshape(-1)[-1].item()
    return audio.to(torch.float32).reshape(-1).numpy(), int(rate)


def finish_reason(reason: str | None) -> FinishReason:
    return {"length": FinishReason.LENGTH, "abort": FinishReason.ABORT}.get(reason or "stop", FinishReason.STOP)


def multimodal_prompt(text: str, media: list[Decoded], audio_rate: int) -> dict[str, Any]:
    """The prompt as vLLM-Omni hands it to the stage-0 input processor: the templated text, the media by
    modality in prompt order (``multi_modal_data``; audio as (samples, rate)), and the processor options."""
    kwargs = qwen3_omni.processor_media(media)
    videos = [m for m in media if isinstance(m, Video)]
    if kwargs.get("use_audio_in_video") and any(isinstance(m, Audio) for m in media):
        # vLLM pairs every audio item with a video under use_audio_in_video (Qwen3-Omni's
        # _derive_audio_from_video_placeholders raises otherwise); the transformers family takes both.
        raise InvalidStageInput(
            "mm_processor_kwargs.use_audio_in_video: this engine takes no audio parts beside videos with their "
            "own audio track",
            "mm_processor_kwargs.use_audio_in_video",
        )
    data: dict[str, Any] = {}
    if kwargs["images"]:
        data["image"] = kwargs["images"]
    if kwargs["audio"]:
        data["audio"] = [(samples, audio_rate) for samples in kwargs["audio"]]
    if kwargs["videos"]:
        data["video"] = kwargs["videos"]
    options = {k: kwargs[k] for k in ("fps", "use_audio_in_video") if videos}
    return {"prompt": text, "multi_modal_data": data, "mm_processor_kwargs": options}


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Prompt token ids of a chat: the template rendered as text, then encoded.

    Rendering to text first keeps this independent of what ``apply_chat_template(tokenize=True)``
    returns (a list in transformers 4, a ``BatchEncoding`` in 5, whose ``list()`` is its keys).
    The template writes the special tokens itself, so none are added.
    """
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja2 raises TemplateError for conversations the template refuses
        raise InvalidStageInput(f"messages: the model's chat template refused them: {err}") from None
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


class CodecRows:
    """New codec frames of a talker request, step by step, without re-concatenating old ones.

    vLLM-Omni accumulates ``codes.audio`` per request: one tensor after the prefill step (a
    placeholder row per prompt position, all zero), then a growing list of per-step tensors,
    and one consolidated tensor when the request finishes. ``new`` returns the rows not seen
    before, from any of these shapes, without the all-zero placeholder rows (vLLM-Omni's own
    codec chunker skips those too).
    """

    def __init__(self) -> None:
        self.rows = 0  # rows seen, placeholders included
        self._parts = 0  # list parts already seen, and the rows they hold
        self._parts_rows = 0

    def new(self, value: Any) -> Any:
        import torch

        if isinstance(value, (list, tuple)):
            if self._parts_rows > self.rows or len(value) < self._parts:
                self._parts = self._parts_rows = 0
            fresh = []
            for part in value[self._parts :]:
                part = part.reshape(-1, part.shape[-1])
                skip = max(self.rows - self._parts_rows, 0)
                if skip < len(part):
                    fresh.append(part[skip:])
                self._parts += 1
                self._parts_rows += len(part)
            rows = torch.cat(fresh) if fresh else None
        elif isinstance(value, torch.Tensor):
            rows = value.reshape(-1, value.shape[-1])[self.rows :]
            self._parts = self._parts_rows = 0  # a list that follows is walked from its start once
        else:
            rows = None
        if rows is None or len(rows) == 0:
            return None
        self.rows += len(rows)
        rows = rows[rows.any(dim=1)]
        return rows.detach().cpu() if len(rows) else None


async def _pump_outputs(client: Any, processor: Any, queues: dict[str, Any], scheduler: _SchedulerSnapshot) -> None:
    """Engine outputs -> per-request collectors. Holds no engine reference (like AsyncLLM's handler)."""
    try:
        while True:
            outputs = await client.get_output_async()
            processed = processor.process_outputs(outputs.outputs, outputs.timestamp, None)
            for output in processed.request_outputs:  # outputs of requests registered without a queue
                queue = queues.get(output.request_id)
                if queue is not None:
                    queue.put(output)
            if processed.reqs_to_abort:
                await client.abort_requests_async(processed.reqs_to_abort)
            if outputs.scheduler_stats is not None:
                scheduler.running = outputs.scheduler_stats.num_running_reqs
                scheduler.waiting = outputs.scheduler_stats.num_waiting_reqs
    except asyncio.CancelledError:
        raise
    except Exception as err:  # engine dead: every waiting request gets the error
        logger.exception("vllm_omni output pump failed")
        processor.propagate_error(err)
        for queue in queues.values():
            queue.put(err)
        raise


@dataclass
class _SchedulerSnapshot:
    """The EngineCore's latest scheduler stats (sent with its outputs while it steps)."""

    running: int = 0
    waiting: int = 0


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


class VllmOmniEngine(StageEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.args = EngineArgs.model_validate(engine_args)
        self._client: Any = None
        self._processor: Any = None
        self._vllm_config: Any = None
        self._tokenizer: Any = None
        self._speakers: dict[str, int] = {}
        self._code_groups = 16  # Qwen3-Omni's; start() reads the checkpoint's
        self._samples_per_frame = 1920
        self._vocoder_lag = 0  # samples a lone decode holds back at its end (code2wav; measured in start())
        self._pump: asyncio.Task[None] | None = None
        self._scheduler = _SchedulerSnapshot()
        # Engine request ids are minted here, one per stage call, never taken from the client:
        # vLLM-Omni treats a second request with a live id as a streaming update of the first.
        self._call_ids = itertools.count()
        # engine request id -> its collector; client request id -> its engine request ids (for abort)
        self._queues: dict[str, Any] = {}
        self._inflight: dict[str, set[str]] = {}
        self._aborted = 0
        self._generated = 0  # tokens (thinker) or codec steps (talker) the engine produced, since start
        self._input_processor: Any = None  # thinker: vLLM's input processor for prompts with media
        self._media_thread: Any = None

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        import vllm_omni  # noqa: F401  - first: patches vLLM in this process

        await asyncio.to_thread(self._launch)
        from vllm_omni.outputs.output_processor import MultimodalOutputProcessor

        model_config = self._vllm_config.model_config
        if not model_config.skip_tokenizer_init:
            from vllm.tokenizers import cached_tokenizer_from_config

            self._tokenizer = cached_tokenizer_from_config(model_config=model_config)
        hf_config = model_config.hf_config  # the whole omni config, whatever the stage
        talker_config = getattr(hf_config, "talker_config", None)
        self._speakers = {k.lower(): int(v) for k, v in (getattr(talker_config, "speaker_id", None) or {}).items()}
        code2wav_config = getattr(hf_config, "code2wav_config", None)
        if code2wav_config is not None:
            self._code_groups = int(code2wav_config.num_quantizers)
            self._samples_per_frame = math.prod(code2wav_config.upsample_rates) * math.prod(
                code2wav_config.upsampling_ratios
            )
        self._processor = MultimodalOutputProcessor(
            tokenizer=self._tokenizer,
            log_stats=False,
            engine_core_output_type=self.args.engine.get("engine_output_type"),
        )
        self._pump = asyncio.create_task(_pump_outputs(self._client, self._processor, self._queues, self._scheduler))
        if self.args.model_stage == "thinker" and self._tokenizer is not None:
            self._start_media_input()
        if self.args.model_stage == "code2wav" and self.args.pipeline == "qwen3_omni_moe":
            self._vocoder_lag = await self._measure_vocoder_lag()

    async def _measure_vocoder_lag(self) -> int:
        """Decode one frame alone: the samples it lacks of a whole frame are the vocoder's lag.

        vLLM-Omni batches code2wav requests zero-padded to the longest, and a shorter request then
        gets its held-back tail computed from the padding: cutting every decode to
        ``frames * samples_per_frame - lag`` keeps a request's audio independent of its batch.
        (vLLM-Omni's ``Qwen3OmniMoeForConditionalGeneration.forward``, code2wav branch; no upstream
        issue found: its own streaming path trims by left context and never returns that tail.)
        """
        request = StageRequest(request_id="vocoder-lag", sampling=SamplingParams(temperature=0.0))
        prompt = {"prompt_token_ids": [1] * self._code_groups}
        async for output in self._generate(request, prompt, self._params(request, "FINAL_ONLY")):
            if output.finished:
                audio, _ = audio_samples(multimodal_output(output))
                return max(self._samples_per_frame - len(audio), 0)
        raise EngineError(f"stage {self.stage_name}: the warm-up decode returned no audio")

    def _launch(self) -> None:
        """Build this stage's VllmConfig, spawn its EngineCore and attach the client (blocking; in a thread)."""
        from vllm_omni.config.yaml_util import create_config
        from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClientBase
        from vllm_omni.engine.stage_engine_startup import launch_stage_replica
        from vllm_omni.engine.stage_init_utils import (
            build_engine_args_dict,
            build_vllm_config,
            extract_legacy_stage_metadata,
        )

        from omni_serve.checkpoints.tiny_omni import resolve_model

        model = resolve_model(self.args.model)  # "tiny": the local tiny Qwen3-Omni, built on first use
        cfg = create_config(stage_config(self.args))
        metadata = extract_legacy_stage_metadata(cfg)
        engine_args = build_engine_args_dict(cfg, model)
        vllm_config, executor_class = build_vllm_config(cfg, model, engine_args_dict=engine_args)
        # The EngineCore's readiness handshake runs when launch_stage_replica's context exits, and the
        # client's constructor waits for a ready engine: the client must be made after leaving the
        # context, as vLLM-Omni's StageRuntime does (creating it inside deadlocks every stage start).
        # log_stats: the EngineCore then sends scheduler stats (running/waiting) with its outputs.
        with launch_stage_replica(vllm_config, executor_class, True, self.args.stage_id, stage_config=cfg) as res:
            manager, coordinator, zmq = res.manager, res.coordinator, res.addresses
        addresses = {"input_address": zmq.inputs[0], "output_address": zmq.outputs[0]}
        if zmq.frontend_stats_publish_address is not None:
            addresses["stats_update_address"] = zmq.frontend_stats_publish_address
        try:
            self._client = StageEngineCoreClientBase.make_async_mp_client(
                vllm_config=vllm_config,
                executor_class=executor_class,
                log_stats=True,
                metadata=metadata,
                client_addresses=addresses,
                engine_manager=manager,
                coordinator=coordinator,
            )
        except BaseException:
            if manager is not None:  # the EngineCore process must not outlive a failed start
                manager.shutdown()
            raise
        self._vllm_config = vllm_config

    def _start_media_input(self) -> None:
        """The stage-0 input processor vLLM-Omni builds for its entry stage: it runs the checkpoint's HF
        processor on a prompt's media and expands the placeholders. It runs on one thread of its own
        (the HF processor is CPU-bound; vLLM's processor cache is not shared between threads)."""
        from concurrent.futures import ThreadPoolExecutor

        from vllm_omni.engine.stage_init_utils import build_stage0_input_processor

        self._input_processor = build_stage0_input_processor(self._vllm_config)
        self._media_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.stage_name}-media")
        try:
            info = self._input_processor.renderer.mm_processor.info
            self.audio_input_rate = int(info.get_feature_extractor().sampling_rate)
        except Exception as err:  # a pipeline without a feature extractor: Whisper's rate
            logger.info("stage %s: audio input rate from the processor unavailable (%s)", self.stage_name, err)

    async def _media_prompt(
        self, request: StageRequest, turns: list[dict[str, Any]], params: Any
    ) -> tuple[list[int], Any]:
        """Prompt ids with the media placeholders expanded, and the media features for the EngineCore."""
        try:
            text = self._tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # jinja2 raises TemplateError for conversations the template refuses
            raise InvalidStageInput(f"messages: the model's chat template refused them: {err}") from None
        prompt = multimodal_prompt(text, request.media or [], self.audio_input_rate)
        loop = asyncio.get_running_loop()
        try:
            processed = await loop.run_in_executor(
                self._media_thread,
                lambda: self._input_processor.process_inputs(
                    request.request_id, prompt, params, supported_tasks=("generate",)
                ),
            )
        except ValueError as err:  # vLLM's input validation (e.g. a prompt over max_model_len)
            raise InvalidStageInput(f"messages: {err}", "messages") from None
        return [int(i) for i in processed.prompt_token_ids], processed.mm_features

    def shutdown(self) -> None:
        """Stop the output loop and the EngineCore process."""
        if self._media_thread is not None:
            self._media_thread.shutdown(wait=False, cancel_futures=True)
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        if self._client is not None:
            client, self._client = self._client, None
            client.shutdown()

    async def check_health(self) -> None:
        if self._client is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        if self._pump is not None and self._pump.done():
            raise EngineError(f"stage {self.stage_name}: engine output loop stopped")
        self._client.check_health()

    def stats(self) -> dict[str, Any]:
        """``running`` + ``waiting`` = ``in_flight``; ``aborted`` counts stage calls ended early,
        ``generated`` the tokens (codec steps for a talker) the engine produced since start.

        ``in_flight`` is vLLM's own count of unfinished engine requests (its output processor drops
        a request only when it finishes or is aborted, so a request left running shows here); the
        split comes from the EngineCore's latest scheduler stats, which it sends only while it steps.
        """
        in_flight = self._processor.get_num_unfinished_requests() if self._processor is not None else 0
        running = min(self._scheduler.running, in_flight)
        return {
            "running": running,
            "waiting": in_flight - running,
            "in_flight": in_flight,
            "stream_calls": len(self._queues),
            "aborted": self._aborted,
            "generated": self._generated,
            "vocoder_lag": self._vocoder_lag,  # code2wav: samples a decode holds back (measured in start)
        }

    def voices(self) -> list[str]:
        """The talker's speaker names (lower case, as vLLM-Omni matches them); other stages have none."""
        return sorted(self._speakers) if self.args.model_stage == "talker" else []

    async def abort(self, request_id: str) -> None:
        internal = self._inflight.pop(request_id, set())
        if internal and self._client is not None:
            ids = self._processor.abort_requests(list(internal), internal=False)
            await self._client.abort_requests_async(ids)

    # -- requests ----------------------------------------------------------

    async def _generate(
        self, request: StageRequest, prompt: dict[str, Any], params: Any, mm_features: Any = None
    ) -> AsyncIterator[Any]:
        """One engine request; yields ``RequestOutput``s until finished, aborts it if the caller leaves."""
        from vllm.v1.engine.output_processor import RequestOutputCollector
        from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

        if self._client is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        model_config = self._vllm_config.model_config
        room = model_config.max_model_len - len(prompt["prompt_token_ids"])
        if room <= 0:
            raise InvalidStageInput(
                f"stage {self.stage_name}: prompt of {len(prompt['prompt_token_ids'])} tokens does not fit "
                f"max_model_len={model_config.max_model_len}"
            )
        if params.max_tokens is None or params.max_tokens > room:
            params.max_tokens = room
        rid = f"{self.stage_name}-{next(self._call_ids)}-{request.request_id}"
        core_request = build_engine_core_request_from_tokens(
            rid, prompt, params, model_config=model_config, mm_features=mm_features
        )
        core_request.external_req_id = rid
        queue = RequestOutputCollector(params.output_kind, rid)
        self._queues[rid] = queue
        self._inflight.setdefault(request.request_id, set()).add(rid)
        finished = False
        try:
            self._processor.add_request(core_request, None, None, 0, queue)
            await self._client.add_request_async(core_request)
            while not finished:
                output = await queue.get()
                finished = output.finished
                self._generated += len(output.outputs[0].token_ids)  # DELTA / FINAL_ONLY: counted once
                yield output
        finally:
            self._queues.pop(rid, None)
            ids = self._inflight.get(request.request_id)
            if ids is not None:
                ids.discard(rid)
                if not ids:
                    self._inflight.pop(request.request_id, None)
            if not finished:  # cancelled, closed early or failed: free the engine slot
                self._aborted += 1
                aborted = self._processor.abort_requests([rid], internal=False)
                if self._client is not None:
                    await asyncio.shield(self._client.abort_requests_async(aborted))

    def _params(self, request: StageRequest, output_kind: str, **overrides: Any) -> Any:
        from vllm.sampling_params import RequestOutputKind

        sampling = request.sampling.model_copy(update=overrides) if overrides else request.sampling
        return vllm_sampling_params(sampling, self.args.sampling_constraints, RequestOutputKind[output_kind])

    def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        if self.args.model_stage == "thinker":
            return self._thinker(request)
        if handoff is None:
            raise InvalidStageInput(f"stage {self.stage_name}: needs a handoff from its upstream stage")
        if self.args.model_stage == "talker":
            return self._talker(request, handoff)
        return self._code2wav(request, handoff)

    async def _thinker(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        if not request.messages:
            raise InvalidStageInput(f"stage {self.stage_name}: the entry stage needs messages")
        if self._tokenizer is None:
            raise EngineError(f"stage {self.stage_name}: the thinker needs its tokenizer (skip_tokenizer_init set)")
        turns = qwen3_omni.template_messages(request.messages)
        # DELTA: each output carries only its new tokens; vLLM-Omni concatenates the accumulated
        # hidden states once, at the end (CUMULATIVE would re-concatenate them every step).
        params = self._params(request, "DELTA")
        mm_features = None
        if request.media:
            prompt_ids, mm_features = await self._media_prompt(request, turns, params)
        else:
            prompt_ids = chat_prompt_ids(self._tokenizer, turns)
        if request.reply is not None:
            async for output in self._speak(request, prompt_ids):
                yield output
            return
        token_ids: list[int] = []
        # vLLM's return_prompt_text: the prompt as the model sees it (media placeholders expanded), once.
        prompt_text = (
            self._tokenizer.decode(prompt_ids, skip_special_tokens=False) if request.return_prompt_text else None
        )
        async for output in self._generate(request, {"prompt_token_ids": prompt_ids}, params, mm_features):
            completion = output.outputs[0]
            token_ids.extend(completion.token_ids)
            delta = StageOutput(stage=self.stage_name, text=completion.text, token_ids=list(completion.token_ids))
            delta.prompt_text, prompt_text = prompt_text, None
            if output.finished:
                delta.finished = True
                delta.finish_reason = finish_reason(completion.finish_reason)
                delta.usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids))
                if request.wants_handoff:  # text-only requests: nobody would read the hidden states
                    delta.handoff = handoffs.thinker_handoff(
                        self.args.pipeline,
                        request_id=request.request_id,
                        prompt_token_ids=prompt_ids,
                        output_token_ids=token_ids,
                        multimodal_output=multimodal_output(output),
                        hf_config=self._vllm_config.model_config.hf_config,
                        stopped=completion.finish_reason == "stop",
                    )
            if delta.finished or delta.text or delta.token_ids or delta.prompt_text:
                yield delta

    async def _speak(self, request: StageRequest, prompt_ids: list[int]) -> AsyncIterator[StageOutput]:
        """Teacher-force ``request.reply`` as the assistant turn (text to speech).

        The reply's tokens are appended to the prompt and the engine runs one prefill over
        all of them, sampling a single token that is then replaced by <|im_end|>: the hidden
        states are those of exactly this text, the same rows generation would have produced
        had it sampled these tokens and stopped (the stop token's own row is never computed).
        """
        reply = [int(i) for i in self._tokenizer.encode(request.reply or "", add_special_tokens=False)]
        if not reply:
            raise InvalidStageInput("input: the text to speak is empty")
        im_end = self._tokenizer.convert_tokens_to_ids("<|im_end|>")
        params = self._params(request, "FINAL_ONLY", max_tokens=1, temperature=0.0, stop=[], stop_token_ids=[])
        async for output in self._generate(request, {"prompt_token_ids": prompt_ids + reply}, params):
            if not output.finished:
                continue
            handoff = None
            if request.wants_handoff:
                handoff = handoffs.thinker_handoff(
                    self.args.pipeline,
                    request_id=request.request_id,
                    prompt_token_ids=prompt_ids,
                    output_token_ids=[*reply, im_end],
                    multimodal_output=multimodal_output(output),
                    hf_config=self._vllm_config.model_config.hf_config,
                    stopped=True,
                )
            yield StageOutput(
                stage=self.stage_name,
                text=request.reply or "",
                token_ids=reply,
                finished=True,
                finish_reason=FinishReason.STOP,
                usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(reply) + 1),
                handoff=handoff,
            )

    def _voice(self, voice: str | None) -> str | None:
        if voice is None:
            return None
        if voice.lower() not in self._speakers:
            raise InvalidStageInput(f"voice: unknown voice {voice!r}; valid voices: {sorted(self._speakers)}")
        return voice.lower()

    async def _talker(self, request: StageRequest, handoff: HandoffPayload) -> AsyncIterator[StageOutput]:
        pipeline = self.args.pipeline
        voice = self._voice(request.voice)
        prompt = handoffs.talker_prompt(pipeline, handoff, request_id=request.request_id, voice=voice)
        if not prompt["prompt_token_ids"]:  # the EngineCore would die on it (assert num_new_tokens > 0)
            raise EngineError(f"stage {self.stage_name}: the thinker's handoff has no assistant turn to speak")
        # DELTA: vLLM-Omni keeps the codec frames as a list of per-step tensors until the end.
        # A frame's residual code groups come with the next step, so the last sampled token never
        # gets a frame: one more step yields max_tokens whole frames (as in the transformers family).
        params = self._params(request, "DELTA", max_tokens=request.sampling.max_tokens + 1)
        # Not reproducible per seed: vLLM-Omni 0.30's Qwen3-Omni code predictor samples the residual
        # code groups from the worker's global RNG (its talker_mtp ignores the per-request generator the
        # runner builds from extra_args["tts_local_seed"], which only Qwen3-TTS uses). No upstream issue found.
        chunker = None
        if self.args.codec_chunk is not None:
            chunker = handoffs.AsyncChunkTransfer(
                pipeline,
                request.request_id,
                chunk_frames=self.args.codec_chunk.chunk_frames,
                left_context_frames=self.args.codec_chunk.left_context_frames,
                initial_chunk_frames=self.args.codec_chunk.initial_chunk_frames,
                stop_token_ids=list(params.stop_token_ids or ()),
            )
        rows = CodecRows()
        frames: list[Any] = []
        token_ids: list[int] = []
        async for output in self._generate(request, prompt, params):
            completion = output.outputs[0]
            token_ids.extend(completion.token_ids)
            fresh = rows.new(_lookup(multimodal_output(output), "codes.audio"))
            if fresh is not None:
                if chunker is None:
                    frames.append(fresh)
                else:
                    for row in range(len(fresh)):
                        payload = chunker.push(fresh[row : row + 1], finished=False)
                        if payload is not None:
                            yield StageOutput(stage=self.stage_name, handoff=payload)
            if not output.finished:
                continue
            import torch

            if chunker is not None:
                final = chunker.push(torch.zeros((0, 0), dtype=torch.long), finished=True)
            else:
                final = handoffs.talker_handoff(
                    pipeline,
                    request_id=request.request_id,
                    output_token_ids=token_ids,
                    codes=torch.cat(frames) if frames else None,
                )
            yield StageOutput(
                stage=self.stage_name,
                handoff=final,
                finished=True,
                finish_reason=finish_reason(completion.finish_reason),
                usage=Usage(prompt_tokens=len(prompt["prompt_token_ids"]), completion_tokens=len(token_ids)),
            )

    async def _code2wav(self, request: StageRequest, handoff: HandoffPayload) -> AsyncIterator[StageOutput]:
        prompt = handoffs.code2wav_prompt(self.args.pipeline, handoff)
        left = int((prompt.get("additional_information") or {}).get("meta", {}).get("left_context_size", 0))
        async for output in self._generate(request, prompt, self._params(request, "FINAL_ONLY")):
            if not output.finished:
                continue
            audio, rate = audio_samples(multimodal_output(output))
            # vLLM-Omni's code2wav honours a chunk's left context only in its async-chunk mode, where it
            # waits for chunks from its own connector; here a chunk arrives whole, so it decodes the
            # context frames too and the replica cuts their samples, as the transformers family does.
            frames = len(prompt["prompt_token_ids"]) // self._code_groups
            audio = audio[: frames * self._samples_per_frame - self._vocoder_lag]  # see _measure_vocoder_lag
            audio = qwen3_omni.trim_left_context(audio, frames, left, self._samples_per_frame)
            yield StageOutput(
                stage=self.stage_name,
                audio=audio,
                sample_rate=rate,
                finished=True,
                finish_reason=FinishReason.STOP,
                usage=Usage(prompt_tokens=len(prompt["prompt_token_ids"])),
            )
