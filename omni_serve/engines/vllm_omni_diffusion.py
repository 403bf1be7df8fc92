"""The ``vllm_omni_diffusion`` engine family: Qwen-Image on vLLM-Omni 0.30's own diffusion engine (GPU path).

One replica owns one ``vllm_omni.diffusion.diffusion_engine.DiffusionEngine``, built and
driven the way vLLM-Omni 0.30 serves a lone diffusion stage (``InlineStageDiffusionClient``):

1. ``OmniDiffusionConfig.from_kwargs(**diffusion_config_kwargs(args))`` (see
   :func:`diffusion_config_kwargs`): the parallel options become a
   ``DiffusionParallelConfig`` (``tensor_parallel_size``, ``ulysses_degree``, ``ring_degree``,
   ``cfg_parallel_size``, ...; the worker count ``num_gpus`` is their product) and the
   cache options ``cache_backend`` + a ``DiffusionCacheConfig`` (TeaCache, cache-dit);
2. ``od_config.enrich_config()`` resolves the pipeline class from the checkpoint's
   ``model_index.json``; only ``QwenImagePipeline`` is accepted (the request mapping below
   is Qwen-Image's);
3. ``DiffusionEngine.make_engine(od_config)`` builds the executor (``uni`` in-process for
   one GPU, ``mp`` worker processes otherwise), loads the weights and runs vLLM-Omni's
   warm-up request;
4. each request is an ``OmniDiffusionRequest`` consumed through
   ``DiffusionEngine.step_streaming`` on the replica's event loop.

Requests (:func:`diffusion_request_fields`, pure): the prompt is the last user message;
:class:`~omni_serve.types.ImageParams` maps as vLLM-Omni's ``/v1/images/generations`` maps
its body for Qwen-Image: size -> ``width``/``height``, steps -> ``num_inference_steps``,
``n`` -> ``num_outputs_per_prompt``, ``seed`` -> ``seed``, and the true-CFG scale ->
``true_cfg_scale`` (Qwen-Image's pipeline reads ``guidance_scale`` only for guidance-distilled
transformers). The negative prompt is sent only when true CFG runs (scale > 1), exactly as
the ``diffusers`` family decides, because vLLM-Omni's Qwen-Image falls back to
``true_cfg_scale=4.0`` whenever a negative prompt is present. The seed goes to a CPU
``torch.Generator`` (``generator_device="cpu"``, honoured by vLLM-Omni's model runner), so
a seed gives the same image on any GPU; the ``n`` images of a request draw in turn from
that one generator and differ. Sizes must be multiples of 16 (Qwen-Image's 8x VAE and 2x2
patches): vLLM-Omni would silently round them down, here they are rejected.

Cancellation, as far as 0.30 allows: a cancelled call (the ladder aborts it) or :meth:`abort`
calls ``DiffusionEngine.abort``, which drops a queued request at once. A request already inside
a full forward (the default request mode) runs to its end and the result is discarded;
with ``step_execution: true`` the engine schedules one denoising step at a time and an
abort takes effect at the next step. Qwen-Image does not implement vLLM-Omni's
cooperative in-forward cancellation (``supports_request_cancellation``).
Step pacing (``min_step_s``, :mod:`omni_serve.pacing`) needs that mode too: each scheduled
denoising step then takes at least ``min_step_s`` in the engine's model runner.

``stats()`` reports ``waiting`` (submitted, not yet admitted by the diffusion scheduler)
and ``running`` (admitted), from the engine's request-started events
(``emit_request_lifecycle``), which ``omni_serve.graph.autoscaling`` reads.

``load_format: dummy`` has no image path in 0.30's diffusion engine (it skips building the
pipeline), so random-weight tests point ``model`` at a small diffusers-layout checkpoint.
Only the pydantic ``EngineArgs`` is imported at graph validation; ``vllm_omni`` is imported
in :meth:`VllmOmniDiffusionEngine.start`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.engines.base import StageEngine
from omni_serve.engines.diffusers import prompt_of
from omni_serve.models import image_params
from omni_serve.pacing import engine_config, min_step_field
from omni_serve.payload import HandoffPayload
from omni_serve.types import EngineError, FinishReason, ImageParams, InvalidStageInput, StageOutput, StageRequest

logger = logging.getLogger("ray.serve")

# Qwen-Image: 8x VAE downsampling and 2x2 latent patches -> pixel sizes are multiples of 16.
SIZE_MULTIPLE = 16
# The pipeline classes (model_index.json ``_class_name``) whose request mapping this family implements.
QWEN_IMAGE_PIPELINES = frozenset({"QwenImagePipeline"})
# omni_serve.platforms.paced_diffusion.PacedDiffusionModelRunner, named without importing vLLM-Omni.
PACED_DIFFUSION_RUNNER = "omni_serve.platforms.paced_diffusion.PacedDiffusionModelRunner"


class ParallelArgs(BaseModel):
    """vLLM-Omni ``DiffusionParallelConfig`` fields; the replica needs their product of GPUs."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1, description="Tensor parallel degree of the DiT (and text encoder).")
    ulysses_degree: int = Field(1, ge=1, description="Ulysses sequence-parallel degree (all-to-all attention).")
    ring_degree: int = Field(1, ge=1, description="Ring sequence-parallel degree (ring attention).")
    ulysses_mode: Literal["strict", "advanced_uaa"] = Field(
        "strict", description="'advanced_uaa' allows uneven sequence lengths / head counts under Ulysses."
    )
    cfg_parallel_size: int = Field(
        1, ge=1, le=2, description="2 runs the positive and negative true-CFG passes on two GPUs in parallel."
    )
    vae_patch_parallel_size: int = Field(1, ge=1, description="GPUs that decode VAE tiles in parallel.")

    @property
    def world_size(self) -> int:
        """GPUs one replica uses (vLLM-Omni's ``num_gpus``; data parallel stays 1 inside a replica)."""
        return self.tensor_parallel_size * self.ulysses_degree * self.ring_degree * self.cfg_parallel_size

    @model_validator(mode="after")
    def _check(self) -> ParallelArgs:
        if self.vae_patch_parallel_size > self.world_size:
            raise ValueError(
                f"vae_patch_parallel_size={self.vae_patch_parallel_size} exceeds the replica's "
                f"{self.world_size} GPU(s) (tensor_parallel_size * ulysses_degree * ring_degree * cfg_parallel_size)"
            )
        return self


class CacheArgs(BaseModel):
    """vLLM-Omni step caching: ``cache_backend`` plus ``DiffusionCacheConfig`` fields (None = backend default)."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["none", "tea_cache", "cache_dit"] = Field(
        "none", description="none, tea_cache (TeaCache, Qwen-Image coefficients built in) or cache_dit (DBCache)."
    )
    # TeaCache
    rel_l1_thresh: float | None = Field(None, gt=0, description="TeaCache: relative L1 threshold (higher = faster).")
    # cache-dit (DBCache / TaylorSeer / SCM)
    Fn_compute_blocks: int | None = Field(None, ge=0, description="cache-dit: leading blocks always computed.")
    Bn_compute_blocks: int | None = Field(None, ge=0, description="cache-dit: trailing blocks always computed.")
    max_warmup_steps: int | None = Field(None, ge=0, description="cache-dit: steps before caching starts.")
    max_cached_steps: int | None = Field(None, ge=-1, description="cache-dit: most cached steps; -1 = unlimited.")
    max_continuous_cached_steps: int | None = Field(None, ge=-1, description="cache-dit: most cached steps in a row.")
    residual_diff_threshold: float | None = Field(None, ge=0, description="cache-dit: residual difference threshold.")
    enable_taylorseer: bool | None = Field(None, description="cache-dit: TaylorSeer feature forecasting.")
    taylorseer_order: int | None = Field(None, ge=1, description="cache-dit: TaylorSeer order.")
    scm_steps_mask_policy: str | None = Field(None, description="cache-dit: SCM steps mask policy (None = off).")
    scm_steps_policy: str | None = Field(None, description="cache-dit: SCM steps policy ('dynamic' by default).")

    def config(self) -> dict[str, Any]:
        """The ``DiffusionCacheConfig`` fields that were set."""
        return {k: v for k, v in self.model_dump(exclude={"backend"}).items() if v is not None}

    @model_validator(mode="after")
    def _check(self) -> CacheArgs:
        if self.backend == "none" and self.config():
            raise ValueError(f"cache options {sorted(self.config())} need backend tea_cache or cache_dit")
        return self


class EngineArgs(BaseModel):
    """Arguments of a ``vllm_omni_diffusion`` stage (``engine_args`` in the graph file)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Hub id or local path of a diffusers-layout Qwen-Image checkpoint.")
    revision: str | None = Field(None, description="Hub revision of the checkpoint.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weights dtype; auto = bfloat16 (vLLM-Omni's default)."
    )
    parallel: ParallelArgs = Field(default_factory=ParallelArgs, description="Parallelism inside one replica.")
    cache: CacheArgs = Field(default_factory=CacheArgs, description="Step caching (TeaCache / cache-dit).")
    step_execution: bool = Field(
        False, description="Schedule one denoising step at a time: aborts take effect at the next step."
    )
    max_num_seqs: int = Field(1, ge=1, description="Requests the engine batches into one forward.")
    enforce_eager: bool = Field(False, description="Disable torch.compile of the DiT.")
    enable_cpu_offload: bool = Field(False, description="Swap DiT and text encoder between GPU and CPU.")
    enable_layerwise_offload: bool = Field(False, description="Stream DiT blocks from CPU memory.")
    vae_use_slicing: bool = Field(False, description="Decode the batch one image at a time.")
    vae_use_tiling: bool = Field(False, description="Decode in tiles (less memory for large sizes).")
    default_width: int = Field(1024, ge=SIZE_MULTIPLE, description="Width when the request gives no size (chat).")
    default_height: int = Field(1024, ge=SIZE_MULTIPLE, description="Height when the request gives no size.")
    default_num_inference_steps: int = Field(50, ge=1, description="Denoising steps when the request gives none.")
    default_guidance_scale: float = Field(4.0, ge=0.0, description="True-CFG scale when the request gives none.")
    max_pixels: int = Field(2048 * 2048, ge=256, description="Largest width * height a request may ask for.")
    max_inference_steps: int = Field(100, ge=1, description="Most denoising steps a request may ask for.")
    max_images: int = Field(4, ge=1, description="Most images (n) per request.")
    min_step_s: float = min_step_field()  # omni_serve.pacing; per scheduled denoising step (needs step_execution)

    @model_validator(mode="after")
    def _check(self) -> EngineArgs:
        if self.min_step_s and not self.step_execution:
            raise ValueError(
                "min_step_s paces the denoising steps the engine schedules one at a time: set step_execution: true"
            )
        for name in ("default_width", "default_height"):
            if getattr(self, name) % SIZE_MULTIPLE:
                raise ValueError(f"{name}: must be a multiple of {SIZE_MULTIPLE}")
        if self.enable_cpu_offload and self.enable_layerwise_offload:
            raise ValueError("enable_cpu_offload and enable_layerwise_offload are exclusive")
        return self


def create(stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    return VllmOmniDiffusionEngine(stage_name, engine_args)


# ---------------------------------------------------------------------------
# Pure pieces (tested on CPU)
# ---------------------------------------------------------------------------


def diffusion_config_kwargs(args: EngineArgs) -> dict[str, Any]:
    """``OmniDiffusionConfig.from_kwargs`` arguments for this stage.

    ``min_step_s``: vLLM-Omni's model-runner override names omni_serve's paced runner, and the
    value reaches it in ``additional_config`` (:mod:`omni_serve.platforms.paced`).
    """
    pacing = (
        {"diffusion_model_runner_cls": PACED_DIFFUSION_RUNNER, "additional_config": engine_config(args.min_step_s)}
        if args.min_step_s
        else {}
    )
    return {
        "model": args.model,
        "revision": args.revision,
        "dtype": args.dtype,
        "num_gpus": args.parallel.world_size,
        "parallel_config": args.parallel.model_dump(),
        # Always explicit: vLLM-Omni otherwise reads DIFFUSION_CACHE_BACKEND from the environment.
        "cache_backend": args.cache.backend,
        "cache_config": args.cache.config(),
        "step_execution": args.step_execution,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": args.enforce_eager,
        "enable_cpu_offload": args.enable_cpu_offload,
        "enable_layerwise_offload": args.enable_layerwise_offload,
        "vae_use_slicing": args.vae_use_slicing,
        "vae_use_tiling": args.vae_use_tiling,
        **pacing,
    }


def unknown_config_fields(kwargs: dict[str, Any]) -> list[str]:
    """Names in ``kwargs`` that vLLM-Omni's config classes lack (imports ``vllm_omni``).

    ``OmniDiffusionConfig.from_kwargs`` rejects unknown top-level names itself, but
    ``DiffusionCacheConfig.from_dict`` files unknown names under ``_extra_params`` silently.
    """
    from vllm_omni.diffusion.data import DiffusionCacheConfig, DiffusionParallelConfig, OmniDiffusionConfig

    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}

    unknown = [k for k in kwargs if k not in names(OmniDiffusionConfig)]
    for key, cls in (("parallel_config", DiffusionParallelConfig), ("cache_config", DiffusionCacheConfig)):
        unknown += [f"{key}.{k}" for k in kwargs.get(key, {}) if k not in names(cls)]
    return unknown


def resolve_image_params(request: StageRequest, args: EngineArgs) -> ImageParams:
    """The request's image parameters (or the stage defaults), checked; the seed always set."""
    return image_params.resolve_image_params(request, args, SIZE_MULTIPLE)


def diffusion_request_fields(prompt: str, params: ImageParams) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``OmniTextPrompt`` fields, ``OmniDiffusionSamplingParams`` fields) for one Qwen-Image request."""
    true_cfg = params.guidance_scale > 1.0 and params.negative_prompt is not None
    text_prompt: dict[str, Any] = {"prompt": prompt}
    if true_cfg:
        text_prompt["negative_prompt"] = params.negative_prompt
    sampling = {
        "width": params.width,
        "height": params.height,
        "num_inference_steps": params.num_inference_steps,
        "true_cfg_scale": params.guidance_scale,
        "num_outputs_per_prompt": params.n,
        "seed": (params.seed or 0) % image_params.SEED_MOD,
        "generator_device": "cpu",
        # Ask for the engine's "admitted by the scheduler" event (waiting -> running in stats()).
        "emit_request_lifecycle": True,
    }
    return text_prompt, sampling


def image_arrays(images: list[Any]) -> list[np.ndarray]:
    """uint8 HxWx3 arrays from the PIL images vLLM-Omni's Qwen-Image post-processing returns."""
    return [np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8)) for image in images]


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


class VllmOmniDiffusionEngine(StageEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.args = EngineArgs.model_validate(engine_args)
        self._engine: Any = None  # vllm_omni DiffusionEngine
        self._state: dict[str, str] = {}  # engine request id -> "waiting" | "running"
        self._served = 0

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        import vllm_omni  # noqa: F401  - first: patches vLLM in this process

        self._engine = await asyncio.to_thread(self._launch)
        self._engine.executor.register_failure_callback(self._mark_dead)

    def _launch(self) -> Any:
        """Build the OmniDiffusionConfig and the DiffusionEngine (blocking; runs in a thread)."""
        import torch
        from vllm_omni.diffusion.data import OmniDiffusionConfig
        from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

        kwargs = diffusion_config_kwargs(self.args)
        unknown = unknown_config_fields(kwargs)
        if unknown:
            raise EngineError(f"stage {self.stage_name}: vLLM-Omni's diffusion config has no field(s) {unknown}")
        gpus = self.args.parallel.world_size
        if torch.cuda.device_count() < gpus:
            raise EngineError(
                f"stage {self.stage_name}: the parallel options need {gpus} GPU(s) in the replica, "
                f"{torch.cuda.device_count()} visible; set ray_actor_options.num_gpus: {gpus}"
            )
        try:
            od_config = OmniDiffusionConfig.from_kwargs(**kwargs)
        except (AssertionError, TypeError, ValueError) as err:  # DiffusionParallelConfig validates with asserts
            raise EngineError(f"stage {self.stage_name}: invalid vLLM-Omni diffusion config: {err}") from err
        od_config.enrich_config()
        if od_config.model_class_name not in QWEN_IMAGE_PIPELINES:
            raise EngineError(
                f"stage {self.stage_name}: {self.args.model} is a {od_config.model_class_name!r} checkpoint; "
                f"this family serves {sorted(QWEN_IMAGE_PIPELINES)}"
            )
        return DiffusionEngine.make_engine(od_config)

    def _mark_dead(self) -> None:  # the executor's failure callback (a worker process died)
        self.mark_dead("its diffusion executor died")

    async def probe_health(self) -> None:
        if self._engine is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        self._engine.executor.check_health()

    def invalid_input(self, err: BaseException) -> InvalidStageInput | None:
        from vllm_omni.errors import OmniClientError

        return InvalidStageInput(f"stage {self.stage_name}: {err}") if isinstance(err, OmniClientError) else None

    def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def stats(self) -> dict[str, Any]:
        states = list(self._state.values())
        return {
            "waiting": states.count("waiting"),
            "running": states.count("running"),
            "client_requests": self.calls.requests(),
            "served": self._served,
        }

    async def _abort(self, handles: list[str]) -> None:
        if self._engine is not None:
            self._engine.abort(handles)

    # -- requests ----------------------------------------------------------

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        from vllm_omni.diffusion.data import DiffusionRequestAbortedError, is_diffusion_request_started_output
        from vllm_omni.diffusion.request import OmniDiffusionRequest
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        if handoff is not None:
            raise EngineError(f"stage {self.stage_name}: a vllm_omni_diffusion stage takes no upstream handoff")
        if self._engine is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        params = resolve_image_params(request, self.args)
        text_prompt, sampling = diffusion_request_fields(prompt_of(request), params)
        rid = self.calls.mint(request.request_id)
        engine_request = OmniDiffusionRequest(
            prompt=text_prompt, sampling_params=OmniDiffusionSamplingParams(**sampling), request_id=rid
        )
        self._state[rid] = "waiting"
        images: list[Any] = []
        with self.calls.track(request.request_id, rid) as call:
            try:
                async for outputs in self._engine.step_streaming(engine_request):
                    output = outputs[0]
                    if is_diffusion_request_started_output(output):
                        self._state[rid] = "running"
                        continue
                    if output.finished:
                        call.finish()
                        images = list(output.images)
            except DiffusionRequestAbortedError:
                call.finish()  # aborted through abort(): nothing left to free
                yield StageOutput(stage=self.stage_name, finished=True, finish_reason=FinishReason.ABORT)
                return
            finally:
                self._state.pop(rid, None)
        if len(images) != params.n:
            raise EngineError(f"stage {self.stage_name}: expected {params.n} image(s), got {len(images)}")
        self._served += 1
        yield StageOutput(
            stage=self.stage_name, images=image_arrays(images), finished=True, finish_reason=FinishReason.STOP
        )
