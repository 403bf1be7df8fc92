"""The ``vllm_omni_diffusion`` family's engine args, and the vLLM-Omni diffusion config they make.

:class:`EngineArgs` is what a DiT stage's ``engine_args`` may say (pydantic only: cheap to import, graphs are
validated with it); :func:`diffusion_config_kwargs` turns it into ``OmniDiffusionConfig.from_kwargs`` arguments:
the parallel options become a ``DiffusionParallelConfig`` (``tensor_parallel_size``, ``ulysses_degree``,
``ring_degree``, ``cfg_parallel_size``, ...; the worker count ``num_gpus`` is their product) and the cache options
``cache_backend`` + a ``DiffusionCacheConfig`` (TeaCache, cache-dit); :func:`unknown_config_fields` checks them
against vLLM-Omni's own config classes at start.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.models import video_params
from omni_serve.pacing import engine_config, min_step_field

# The pixel grid graph files are checked against: 16, the finest of the image DiTs this kind maps (Qwen-Image:
# 8x VAE downsampling, 2x2 latent patches). A checkpoint's own multiple (its hooks) is checked at start.
SIZE_MULTIPLE = 16
TINY = "tiny-qwen-image"  # what model: tiny names
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
    request_batch_max_wait_ms: float = Field(
        0.0,
        ge=0,
        le=10_000,
        description="How long the engine holds a request for others to batch with (max_num_seqs > 1); 0 = none.",
    )
    diffusion_compile_granularity: Literal["regional", "full"] = Field(
        "regional", description="torch.compile of a DiT without its own compile setup: per block, or whole."
    )
    diffusion_compile_dynamic: bool = Field(True, description="Compile for dynamic shapes (sizes, frame counts).")
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
        description="The pipeline edits images (Qwen-Image-Edit) or animates one (HunyuanVideo-1.5 image-to-video): "
        "every request carries one source image (/v1/images/edits, or an image part in chat), which the stage "
        "decodes; must match the checkpoint.",
    )
    pipeline: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The DiT stage of a vLLM-Omni pipeline (its key in OMNI_PIPELINES, e.g. glm_image), with "
        "stage_id: a stage fed by an upstream takes each request from its upstream's handoff, built by the "
        "stage's declared input processor (e.g. ar2diffusion); a pipeline's only stage (wan2_2_ti2v) takes the "
        "client's, its checkpoint checked against the declaration. Generated graphs set it "
        "(python -m omni_serve.cli.graphs).",
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
        "request_batch_max_wait_ms": args.request_batch_max_wait_ms,
        "diffusion_compile_granularity": args.diffusion_compile_granularity,
        "diffusion_compile_dynamic": args.diffusion_compile_dynamic,
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
