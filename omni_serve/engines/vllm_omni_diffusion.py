"""The ``vllm_omni_diffusion`` engine family: image and video DiTs on vLLM-Omni 0.30's own diffusion engine.

One replica owns one ``vllm_omni.diffusion.diffusion_engine.DiffusionEngine``, built and
driven the way vLLM-Omni 0.30 serves a lone diffusion stage (``InlineStageDiffusionClient``),
on GPUs, or on CPU through omni_serve's platform (:mod:`omni_serve.platforms.cpu`: one device, torch
SDPA attention):

1. ``OmniDiffusionConfig.from_kwargs(**diffusion_config_kwargs(args))`` (see
   :func:`diffusion_config_kwargs`): the parallel options become a
   ``DiffusionParallelConfig`` (``tensor_parallel_size``, ``ulysses_degree``, ``ring_degree``,
   ``cfg_parallel_size``, ...; the worker count ``num_gpus`` is their product) and the
   cache options ``cache_backend`` + a ``DiffusionCacheConfig`` (TeaCache, cache-dit);
2. ``od_config.enrich_config()`` resolves the pipeline class from the checkpoint's
   ``model_index.json``; what vLLM-Omni declares that class makes (``get_diffusion_output_type``)
   picks the request mapping: ``image`` for Qwen-Image (the mapping below is Qwen-Image's, so
   only ``QwenImagePipeline``), ``video`` for any text-to-video pipeline (Wan 2.2 TI2V: vLLM-Omni's
   ``/v1/videos`` mapping, below); anything else is refused at start, but the DiT stage of a vLLM-Omni
   pipeline (``pipeline``, ``stage_id``: its declared ``model_arch``), whose requests its upstream makes;
3. ``DiffusionEngine.make_engine(od_config)`` builds the executor (``uni`` in-process for
   one GPU, ``mp`` worker processes otherwise), loads the weights and runs vLLM-Omni's
   warm-up request;
4. each request is an ``OmniDiffusionRequest`` consumed through
   ``DiffusionEngine.step_streaming`` on the replica's event loop.

Image requests (:func:`diffusion_request_fields`, pure): the prompt is the last user message;
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

Requests of a pipeline's DiT stage (:meth:`VllmOmniDiffusionEngine._from_handoff`; GLM-Image): the stage's
declared input processor (``ar2diffusion``) makes the diffusion prompt from the upstream AR's handoff and the
request's prompt it carries (:func:`omni_serve.models.vllm_omni.edges.diffusion_input`): prior token ids, the
size, the image to edit; the request's steps and guidance (or the stage's defaults) and the AR's seed go to
the sampling params, as vLLM-Omni's multistage image request sets them (one image per request).

Video requests (:func:`video_request_fields`, pure) map :class:`~omni_serve.types.VideoParams` as
vLLM-Omni's ``/v1/videos`` maps its form: size -> ``width``/``height``, ``num_frames``, steps,
``guidance_scale`` (classifier-free guidance, a negative prompt sent whenever given), ``seed`` on a
CPU generator. Sizes must be multiples of the VAE's spatial factor times the transformer's patch and
frame counts of the VAE's temporal factor plus one (both read from the checkpoint's configs at start;
Wan 2.2 TI2V: 32 and 4k + 1); vLLM-Omni rounds others down, here they are rejected
(:mod:`omni_serve.models.video_params`). The frames vLLM-Omni returns ([0, 1] floats) become uint8 as
its server rounds them and are encoded to MP4 in this replica (:func:`omni_serve.media.encode.encode_mp4`:
H.264 at vLLM-Omni's settings, so the same frames make the same file); the file leaves the replica as
its own stream item (:mod:`omni_serve.graph.transport`), never inside the output.

Cancellation, as far as 0.30 allows: a cancelled call (the ladder aborts it) or :meth:`abort`
calls ``DiffusionEngine.abort``, which drops a queued request at once. A request already inside
a full forward (the default request mode) runs to its end and the result is discarded;
with ``step_execution: true`` the engine schedules one denoising step at a time and an
abort takes effect at the next step. Qwen-Image does not implement vLLM-Omni's
cooperative in-forward cancellation (``supports_request_cancellation``).
Step pacing (``min_step_s``, :mod:`omni_serve.pacing`): in that mode each scheduled denoising step
takes at least ``min_step_s`` in the engine's model runner; a whole forward (request mode, or a pipeline
without step execution: GLM-Image's DiT, Wan 2.2) at least its steps times ``min_step_s``. In step mode the
call also reports progress (``StageOutput.progress``: the steps the engine's step scheduler has run,
over the request's steps); otherwise only "admitted" (progress 0) and the result. Pipelines without
vLLM-Omni's step execution (Wan 2.2) run a full forward whatever this says.

``stats()`` reports ``waiting`` (submitted, not yet admitted by the diffusion scheduler)
and ``running`` (admitted), from the engine's request-started events
(``emit_request_lifecycle``), which ``omni_serve.graph.autoscaling`` reads.

``load_format: dummy`` has no image path in 0.30's diffusion engine (it skips building the
pipeline), so random-weight tests point ``model`` at a small diffusers-layout checkpoint: ``tiny``
(Qwen-Image) or another registered name (:mod:`omni_serve.checkpoints`, e.g. ``tiny-wan2.2-ti2v``).
Only the pydantic ``EngineArgs`` is imported at graph validation; ``vllm_omni`` is imported
in :meth:`VllmOmniDiffusionEngine.start`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.engines.base import StageEngine
from omni_serve.engines.family import Family
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.media.encode import encode_mp4
from omni_serve.models import image_params, video_params
from omni_serve.models.image_params import prompt_of
from omni_serve.pacing import engine_config, min_step_field
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, ImageParams, Modality, StageOutput, StageRequest, VideoParams, VideoRules

logger = logging.getLogger("ray.serve")

# Qwen-Image: 8x VAE downsampling and 2x2 latent patches -> pixel sizes are multiples of 16.
SIZE_MULTIPLE = 16
# The image pipeline classes (model_index.json ``_class_name``) whose request mapping this family implements;
# every pipeline vLLM-Omni declares a video maker takes the video mapping.
QWEN_IMAGE_PIPELINES = frozenset({"QwenImagePipeline", "QwenImageEditPipeline"})
# Of those, the ones that edit: the request carries the source image (/v1/images/edits, a chat image part).
EDIT_PIPELINES = frozenset({"QwenImageEditPipeline"})
IMAGE, VIDEO = "image", "video"  # vLLM-Omni's final output types this family serves
TINY = "tiny-qwen-image"  # what model: tiny names
# How often a step-scheduled call looks at its request's step index (progress).
PROGRESS_POLL_S = 0.25
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

    model: str = Field(
        description="Hub id or local path of a diffusers-layout checkpoint (Qwen-Image, or a video pipeline such as "
        "Wan 2.2 TI2V); 'tiny' = the tiny random-weight Qwen-Image, another registered tiny name its checkpoint."
    )
    revision: str | None = Field(None, description="Hub revision of the checkpoint.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Weights dtype; auto = bfloat16 (vLLM-Omni's default). Components vLLM-Omni loads with their "
        "saved dtype (Qwen-Image's text encoder) must match it: float32 for the tiny checkpoints.",
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
    default_num_frames: int = Field(121, ge=1, description="Video: frames when the request gives none.")
    default_fps: float = Field(24.0, gt=0, le=video_params.MAX_FPS, description="Video: frames per second of the MP4.")
    max_frames: int = Field(241, ge=1, description="Video: most frames a request may ask for.")
    image_input: bool = Field(
        False,
        description="The pipeline edits images (Qwen-Image-Edit): every request carries one source image "
        "(/v1/images/edits, or an image part in chat), which the stage decodes; must match the checkpoint.",
    )
    pipeline: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The DiT stage of a vLLM-Omni pipeline (its key in OMNI_PIPELINES, e.g. glm_image), with "
        "stage_id: each request comes from its upstream stage's handoff, built by the stage's declared input "
        "processor (e.g. ar2diffusion). Generated graphs set it (python -m omni_serve.cli.graphs).",
    )
    stage_id: int | None = Field(None, ge=0, description="This stage's id in the pipeline (with pipeline).")
    min_step_s: float = min_step_field()  # omni_serve.pacing; per denoising step (a whole forward: steps x it)

    @model_validator(mode="after")
    def _check(self) -> EngineArgs:
        if (self.pipeline is None) != (self.stage_id is None):
            raise ValueError("pipeline and stage_id go together (the DiT stage of a vLLM-Omni pipeline)")
        if self.pipeline is not None and self.image_input:
            raise ValueError("image_input: a pipeline's DiT stage gets the image to edit in its upstream's handoff")
        for name in ("default_width", "default_height"):
            if getattr(self, name) % SIZE_MULTIPLE:
                raise ValueError(f"{name}: must be a multiple of {SIZE_MULTIPLE}")
        if self.enable_cpu_offload and self.enable_layerwise_offload:
            raise ValueError("enable_cpu_offload and enable_layerwise_offload are exclusive")
        return self


def create(stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    return VllmOmniDiffusionEngine(stage_name, engine_args)


def input_modalities(args: EngineArgs) -> set[Modality]:
    """An editing stage takes the source image as chat input (and /v1/images/edits); the others text only."""
    return {Modality.TEXT, Modality.IMAGE} if args.image_input else {Modality.TEXT}


# ---------------------------------------------------------------------------
# Pure pieces (tested on CPU)
# ---------------------------------------------------------------------------


def diffusion_config_kwargs(args: EngineArgs, model: str | None = None) -> dict[str, Any]:
    """``OmniDiffusionConfig.from_kwargs`` arguments for this stage (``model``: the resolved checkpoint path).

    ``min_step_s``: vLLM-Omni's model-runner override names omni_serve's paced runner, and the
    value reaches it in ``additional_config`` (:mod:`omni_serve.platforms.paced`).
    """
    pacing = (
        {"diffusion_model_runner_cls": PACED_DIFFUSION_RUNNER, "additional_config": engine_config(args.min_step_s)}
        if args.min_step_s
        else {}
    )
    return {
        "model": model or args.model,
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


def resolve_image_params(request: StageRequest, args: EngineArgs) -> image_params.ResolvedImageParams:
    """The request's image parameters (or the stage defaults), checked; the seed always set."""
    return image_params.resolve_image_params(request, args, SIZE_MULTIPLE)


def diffusion_request_fields(
    prompt: str, params: image_params.ResolvedImageParams
) -> tuple[dict[str, Any], dict[str, Any]]:
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


def video_request_fields(prompt: str, params: VideoParams) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``OmniTextPrompt`` fields, ``OmniDiffusionSamplingParams`` fields) for one video request, as vLLM-Omni's
    ``/v1/videos`` builds them from the same values (``serving_video.py``); fps only times the MP4."""
    text_prompt: dict[str, Any] = {"prompt": prompt}
    if params.negative_prompt is not None:
        text_prompt["negative_prompt"] = params.negative_prompt
    sampling = {
        "width": params.width,
        "height": params.height,
        "num_frames": params.num_frames,
        "num_inference_steps": params.num_inference_steps,
        "guidance_scale": params.guidance_scale,
        "num_outputs_per_prompt": 1,
        "seed": (params.seed or 0) % image_params.SEED_MOD,
        "generator_device": "cpu",
        "emit_request_lifecycle": True,
    }
    return text_prompt, sampling


def image_arrays(images: list[Any]) -> list[np.ndarray]:
    """uint8 HxWx3 arrays from the PIL images vLLM-Omni's Qwen-Image post-processing returns."""
    return [np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8)) for image in images]


def video_frames(video: Any) -> np.ndarray:
    """uint8 frames [T, H, W, 3] of one video as vLLM-Omni's pipelines return it ([1,] T, H, W, 3 floats in
    [0, 1]), rounded as vLLM-Omni's server rounds them before it encodes (clip, x 255, round half to even,
    ``video_api_utils._PlanarFrameConverter``)."""
    frames = np.asarray(video)
    if frames.ndim == 5 and frames.shape[0] == 1:
        frames = frames[0]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise EngineError(f"expected video frames [T, H, W, 3], got shape {frames.shape}")
    if frames.dtype == np.uint8:
        return np.ascontiguousarray(frames)
    # In the frames' own float type, as vLLM-Omni's server does: float64 rounds some x.5 values the other
    # way, and one changed input value changes what H.264 makes of a whole block.
    scaled = np.clip(frames, 0.0, 1.0)
    scaled *= 255.0
    return np.rint(scaled).astype(np.uint8)


def video_multiples(model_path: str) -> tuple[int, int]:
    """(size multiple, frame multiple) of a diffusers-layout video checkpoint: the VAE's spatial factor times the
    transformer's spatial patch, and the VAE's temporal factor (what vLLM-Omni's Wan pipeline rounds to)."""
    import json
    import pathlib

    root = pathlib.Path(model_path)
    try:
        vae = json.loads((root / "vae" / "config.json").read_text())
        transformer = json.loads((root / "transformer" / "config.json").read_text())
        patch = transformer["patch_size"]
        return int(vae["scale_factor_spatial"]) * int(patch[-1]), int(vae["scale_factor_temporal"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise EngineError(
            f"{model_path}: cannot read the video sizes from vae/config.json (scale_factor_spatial, "
            f"scale_factor_temporal) and transformer/config.json (patch_size): {type(err).__name__}"
        ) from None


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
        self.output_type = IMAGE  # what vLLM-Omni declares the pipeline makes (set at start)
        self._video_rules: VideoRules | None = None  # a video checkpoint's defaults and limits (known at start)
        self._declared: Any = None  # a pipeline's DiT stage: its StagePipelineConfig (known at start)

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        import vllm_omni  # noqa: F401  - first: patches vLLM in this process

        self._engine = await asyncio.to_thread(self._launch)
        self._engine.executor.register_failure_callback(self._mark_dead)

    def _launch(self) -> Any:
        """Build the OmniDiffusionConfig and the DiffusionEngine (blocking; runs in a thread)."""
        from vllm_omni.diffusion.data import OmniDiffusionConfig
        from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
        from vllm_omni.diffusion.io_support import get_diffusion_output_type
        from vllm_omni.platforms import current_omni_platform

        from omni_serve.checkpoints import resolve

        model = resolve(self.args.model, tiny=TINY)
        kwargs = diffusion_config_kwargs(self.args, model)
        unknown = unknown_config_fields(kwargs)
        if unknown:
            raise EngineError(f"stage {self.stage_name}: vLLM-Omni's diffusion config has no field(s) {unknown}")
        gpus, devices = self.args.parallel.world_size, current_omni_platform.get_device_count()
        if devices < gpus:  # omni_serve's CPU platform counts one device
            raise EngineError(
                f"stage {self.stage_name}: the parallel options need {gpus} device(s) in the replica, "
                f"{devices} visible; set ray_actor_options.num_gpus: {gpus}"
            )
        try:
            od_config = OmniDiffusionConfig.from_kwargs(**kwargs)
        except (AssertionError, TypeError, ValueError) as err:  # DiffusionParallelConfig validates with asserts
            raise EngineError(f"stage {self.stage_name}: invalid vLLM-Omni diffusion config: {err}") from err
        od_config.enrich_config()
        name = od_config.model_class_name
        self.output_type = get_diffusion_output_type(name)
        if self.args.pipeline is not None:
            self._declared = self._declaration(name)
        elif self.output_type == VIDEO:
            multiples = video_multiples(_local_checkpoint(model, self.args.revision))
            self._video_rules = video_params.rules(self.args, *multiples)
        elif self.output_type != IMAGE or name not in QWEN_IMAGE_PIPELINES:
            raise EngineError(
                f"stage {self.stage_name}: {self.args.model} is a {name!r} checkpoint (vLLM-Omni: "
                f"{self.output_type}); this family serves {sorted(QWEN_IMAGE_PIPELINES)} and video pipelines"
            )
        if self._declared is None and self.args.image_input != (name in EDIT_PIPELINES):
            raise EngineError(
                f"stage {self.stage_name}: {self.args.model} is a {name!r} checkpoint: set image_input: "
                f"{str(name in EDIT_PIPELINES).lower()} (requests to an editing pipeline carry the image to edit)"
            )
        return DiffusionEngine.make_engine(od_config)

    def _declaration(self, class_name: str) -> Any:
        """The pipeline's declaration of this stage (``StagePipelineConfig``), checked against the checkpoint."""
        from omni_serve.models.vllm_omni import pipelines

        assert self.args.pipeline is not None and self.args.stage_id is not None  # EngineArgs checks both
        try:
            declared = pipelines.stage(self.args.pipeline, self.args.stage_id)
        except KeyError as err:
            raise EngineError(f"stage {self.stage_name}: {err.args[0]}") from None
        where = f"stage {self.stage_name}: pipeline {self.args.pipeline!r} stage {self.args.stage_id}"
        if pipelines.family(declared) != "vllm_omni_diffusion" or not declared.input_sources:
            raise EngineError(f"{where} ({declared.model_stage}) is not a DiT stage fed by an upstream stage")
        if declared.final_output_type != IMAGE or self.output_type != IMAGE:
            raise EngineError(
                f"{where} makes {declared.final_output_type!r}; this family's pipeline stages draw images"
            )
        if declared.model_arch and declared.model_arch != class_name:
            raise EngineError(f"{where} runs {declared.model_arch}; {self.args.model} is a {class_name!r} checkpoint")
        return declared

    def _mark_dead(self) -> None:  # the executor's failure callback (a worker process died)
        self.mark_dead("its diffusion executor died")

    async def probe_health(self) -> None:
        if self._engine is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        self._engine.executor.check_health()

    def invalid_input(self, err: BaseException) -> InvalidStageInput | None:
        from vllm_omni.errors import OmniClientError

        return InvalidStageInput(f"stage {self.stage_name}: {err}") if isinstance(err, OmniClientError) else None

    def video_rules(self) -> VideoRules | None:
        return self._video_rules

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
            "aborted": self.calls.aborted,
        }

    async def _abort(self, handles: list[str]) -> None:
        if self._engine is not None:
            self._engine.abort(handles)

    # -- requests ----------------------------------------------------------

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        from vllm_omni.diffusion.data import DiffusionRequestAbortedError, is_diffusion_request_started_output
        from vllm_omni.diffusion.request import OmniDiffusionRequest
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        if self._engine is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        if handoff is not None and self._declared is None:
            raise EngineError(f"stage {self.stage_name}: a lone DiT stage takes no upstream handoff")
        if handoff is None and self._declared is not None:
            raise EngineError(f"stage {self.stage_name}: needs its upstream's handoff")
        video: VideoParams | None = None
        if handoff is not None:
            text_prompt, sampling = self._from_handoff(request, handoff)
            expected = 1
        elif self._video_rules is not None:
            if request.image is not None:
                raise InvalidStageInput(f"model: stage {self.stage_name} makes videos, not images", param="model")
            video = video_params.resolve_video_params(request, self._video_rules)
            text_prompt, sampling = video_request_fields(prompt_of(request), video)
            expected = 1
        else:
            if request.video is not None:
                raise InvalidStageInput(f"model: stage {self.stage_name} makes images, not videos", param="model")
            source = self._source_image(request)
            if source is not None and request.image is not None and not request.image.width:  # size "auto"
                height, width = source.shape[:2]
                width, height = image_params.fitted_size(width, height, SIZE_MULTIPLE, self.args.max_pixels)
                request.image = request.image.model_copy(update={"width": width, "height": height})
            params = resolve_image_params(request, self.args)
            text_prompt, sampling = diffusion_request_fields(prompt_of(request), params)
            if source is not None:
                from PIL import Image

                text_prompt["multi_modal_data"] = {"image": Image.fromarray(source)}
            expected = params.n
        rid = self.calls.mint(request.request_id)
        engine_request = OmniDiffusionRequest(
            prompt=text_prompt, sampling_params=OmniDiffusionSamplingParams(**sampling), request_id=rid
        )
        self._state[rid] = "waiting"
        images: list[Any] = []
        with self.calls.track(request.request_id, rid) as call:
            try:
                async for output in self._engine_outputs(engine_request):
                    if isinstance(output, float):  # steps done / steps, from the engine's step scheduler
                        yield StageOutput(stage=self.stage_name, progress=output)
                    elif is_diffusion_request_started_output(output):
                        self._state[rid] = "running"
                        yield StageOutput(stage=self.stage_name, progress=0.0)  # admitted: the work started
                    elif output.finished:
                        call.finish()
                        images = list(output.images)
            except DiffusionRequestAbortedError:
                call.finish()  # aborted through abort(): nothing left to free
                yield StageOutput(stage=self.stage_name, finished=True, finish_reason=FinishReason.ABORT)
                return
            finally:
                self._state.pop(rid, None)
        if len(images) != expected:
            raise EngineError(f"stage {self.stage_name}: expected {expected} output(s), got {len(images)}")
        self._served += 1
        if video is None:
            yield StageOutput(
                stage=self.stage_name, images=image_arrays(images), finished=True, finish_reason=FinishReason.STOP
            )
            return
        frames = video_frames(images[0])
        if frames.shape[:3] != (video.num_frames, video.height, video.width):
            raise EngineError(
                f"stage {self.stage_name}: the pipeline made frames of shape {frames.shape[:3]}, asked "
                f"{(video.num_frames, video.height, video.width)}"
            )
        mp4 = await asyncio.to_thread(encode_mp4, frames, video.fps)  # CPU work, off the replica's event loop
        yield StageOutput(
            stage=self.stage_name,
            video=np.frombuffer(mp4, dtype=np.uint8),
            progress=1.0,
            finished=True,
            finish_reason=FinishReason.STOP,
        )

    def _from_handoff(self, request: StageRequest, handoff: HandoffPayload) -> tuple[dict[str, Any], dict[str, Any]]:
        """(diffusion prompt, ``OmniDiffusionSamplingParams`` fields) of a pipeline's DiT stage, as vLLM-Omni's
        multistage image request builds them: the prompt by the stage's declared input processor from the upstream
        output and the request's entry prompt (:func:`omni_serve.models.vllm_omni.edges.diffusion_input`); the size
        it decided, the request's steps and guidance (or the stage's defaults: the deploy config's), and the seed
        the upstream stage ran with."""
        from omni_serve.models.vllm_omni.edges import diffusion_input

        try:
            prompt = diffusion_input(self._declared, [handoff], request_id=request.request_id)
        except ValueError as err:  # the upstream output does not parse (e.g. too few tokens for the size)
            raise EngineError(f"stage {self.stage_name}: {err}") from None
        # The size ar2diffusion decided and the seed the AR ran with, checked against this stage's limits as any
        # image request is (steps and guidance: the request's, or the stage's defaults).
        given = (request.image or ImageParams(width=0, height=0)).model_copy(
            update={"width": int(prompt["width"]), "height": int(prompt["height"]), "seed": handoff.meta.get("seed")}
        )
        params = resolve_image_params(dataclasses.replace(request, image=given), self.args)
        sampling = {
            "width": params.width,
            "height": params.height,
            "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale,
            "num_outputs_per_prompt": 1,
            "seed": params.seed % image_params.SEED_MOD,
            "emit_request_lifecycle": True,
        }
        return prompt, sampling

    def _source_image(self, request: StageRequest) -> np.ndarray | None:
        """An editing stage's one source image (decoded by the stage from the request's image part); None otherwise."""
        from omni_serve.media.inputs import Image

        media = request.media or []
        if not self.args.image_input:
            if media:
                raise InvalidStageInput(f"messages: stage {self.stage_name} takes no images", param="messages")
            return None
        images = [item.pixels for item in media if isinstance(item, Image)]
        if len(images) != 1 or len(media) != 1:
            raise InvalidStageInput(
                f"image: stage {self.stage_name} edits exactly one image per request (got {len(media)} media item(s))",
                param="image",
            )
        return images[0]

    async def _engine_outputs(self, engine_request: Any) -> AsyncIterator[Any]:
        """The engine's outputs for one request (each ``outputs[0]``), with its step progress between them.

        With ``step_execution`` the engine's step scheduler, on this process's engine thread, writes each
        finished step's index into the request's sampling params; it is read every ``PROGRESS_POLL_S``
        while the engine has not answered, and yielded (a float) when it moved. Without it nothing moves.
        """
        stream = self._engine.step_streaming(engine_request).__aiter__()
        params = engine_request.sampling_params
        total, reported = params.num_inference_steps or 0, 0
        pending = asyncio.ensure_future(anext(stream))
        try:
            while True:
                if self.args.step_execution and total:
                    done, _ = await asyncio.wait({pending}, timeout=PROGRESS_POLL_S)
                    step = min(params.step_index or 0, total)
                    if step > reported:
                        reported = step
                        yield step / total
                    if not done:
                        continue
                try:
                    outputs = await pending
                except StopAsyncIteration:
                    return
                yield outputs[0]
                pending = asyncio.ensure_future(anext(stream))
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await pending
            await stream.aclose()


def _local_checkpoint(model: str, revision: str | None) -> str:
    """A directory with the checkpoint's config files: ``model`` itself, or the hub's cached snapshot of them."""
    import os

    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, allow_patterns=["*/config.json", "model_index.json"])


FAMILY = Family(EngineArgs, create, input_modalities=input_modalities)
