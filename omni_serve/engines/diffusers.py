"""The ``diffusers`` engine family: Qwen-Image text-to-image with Hugging Face diffusers.

One engine runs one ``pipeline_stage`` of ``QwenImagePipeline``:

- ``full``: prompt -> image in one stage;
- ``encode``: the Qwen2.5-VL text encoder -> prompt embeddings (+ mask, + the negative
  prompt's when one is given), handed off as ``qwen_image.prompt_embeds``;
- ``denoise``: the MMDiT flow-matching loop from those embeddings (the pipeline called
  with ``prompt_embeds`` and ``output_type="latent"``) -> packed latents, handed off as
  ``qwen_image.latents``;
- ``decode``: the VAE -> uint8 images.

``full`` runs exactly the encode, denoise and decode functions of the split stages one
after the other, payloads included, so a one-stage and a three-stage graph give the same
pixels for the same seed. Handoff tensors keep the pipeline's dtype (bf16 on GPUs travels
as 16-bit words, :mod:`omni_serve.graph.transport`): nothing is widened, nothing is lost.

Requests: the prompt is the last user message; :class:`~omni_serve.types.ImageParams`
carries size, steps, true-CFG scale, negative prompt, seed and ``n`` (requests without
it, e.g. chat completions, get this stage's defaults). Image ``i`` of a request uses a
CPU ``torch.Generator`` seeded ``seed + i``: deterministic per seed, independent of the
device and of the global RNG, and the ``n`` images differ.

The pipeline object is stateful (its scheduler holds the timesteps of the current
call), so all model work of an engine runs on one worker thread, one call at a time.
A cancelled request stops at the next denoising step; ``min_step_s`` paces each denoising step
(:mod:`omni_serve.pacing`). Heavy imports happen in
:meth:`DiffusersEngine.start` only.

GPU serving through vLLM-Omni's own diffusion engine (``DiffusionEngine`` with its
sequence-parallel / CFG-parallel and cache-dit/TeaCache options) is the separate
``vllm_omni_diffusion`` family (:mod:`omni_serve.engines.vllm_omni.diffusion`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from omni_serve import payload as handoffs
from omni_serve.engines.base import PacedInProcess, StageEngine
from omni_serve.engines.family import Family
from omni_serve.exceptions import EngineError
from omni_serve.models.image_params import SEED_MOD, ResolvedImageParams, prompt_of, resolve_image_params
from omni_serve.pacing import StepPacer, min_step_field
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, StageOutput, StageRequest

PipelineStage = Literal["full", "encode", "denoise", "decode"]
PROMPT_KIND = "qwen_image.prompt_embeds"
LATENTS_KIND = "qwen_image.latents"


class EngineArgs(BaseModel):
    """Arguments of a ``diffusers`` stage (``engine_args`` in the graph file)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "tiny", description="Hub id or local path of a diffusers Qwen-Image checkpoint; 'tiny' = the built-in tiny one."
    )
    pipeline_stage: PipelineStage = Field(
        "full", description="Which part of the pipeline this stage runs: full, encode, denoise or decode."
    )
    device: str = Field("auto", description="torch device ('cpu', 'cuda', 'cuda:0'); auto = cuda when visible.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; auto = bfloat16 on GPUs, float32 on CPU."
    )
    default_width: int = Field(1024, ge=16, description="Width when the request gives no size (e.g. chat).")
    default_height: int = Field(1024, ge=16, description="Height when the request gives no size.")
    default_num_inference_steps: int = Field(50, ge=1, description="Denoising steps when the request gives none.")
    default_guidance_scale: float = Field(4.0, ge=0.0, description="True-CFG scale when the request gives none.")
    max_pixels: int = Field(2048 * 2048, ge=256, description="Largest width * height a request may ask for.")
    max_inference_steps: int = Field(100, ge=1, description="Most denoising steps a request may ask for.")
    max_images: int = Field(4, ge=1, description="Most images (n) per request.")
    max_sequence_length: int = Field(512, ge=1, le=1024, description="Prompt embeddings are cut to this many tokens.")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU; None keeps torch's.")
    min_step_s: float = min_step_field()  # omni_serve.pacing; per denoising step


def create(stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    return DiffusersEngine(stage_name, engine_args)


class DiffusersEngine(PacedInProcess, StageEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.args = EngineArgs.model_validate(engine_args)
        # One worker thread: the pipeline (its scheduler) serves one call at a time.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"diffusers-{stage_name}")
        self._pending = 0
        self._served = 0
        self._pipe: Any = None  # QwenImagePipeline (full, encode, denoise)
        self._vae: Any = None  # AutoencoderKLQwenImage (full, decode)
        self._image_processor: Any = None
        self._unpack: Any = None
        self.size_multiple = 16
        self.device = "cpu"

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._worker, self._load)

    def _load(self) -> None:
        import torch
        from diffusers import AutoencoderKLQwenImage, QwenImagePipeline
        from diffusers.image_processor import VaeImageProcessor

        from omni_serve.checkpoints.tiny_image import resolve_model

        args = self.args
        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        dtype_name = (
            args.dtype if args.dtype != "auto" else ("bfloat16" if self.device.startswith("cuda") else "float32")
        )
        dtype = getattr(torch, dtype_name)
        path = resolve_model(args.model)
        vae_config = AutoencoderKLQwenImage.load_config(path, subfolder="vae")
        vae_scale_factor = 2 ** len(vae_config["temperal_downsample"])
        # The transformer patches 2x2 latents, so pixel sizes are multiples of 2 * the VAE factor.
        self.size_multiple = vae_scale_factor * 2
        stage = args.pipeline_stage
        if stage in ("full", "decode"):
            self._vae = AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", dtype=dtype)
            self._vae.to(self.device).eval()
            self._image_processor = VaeImageProcessor(vae_scale_factor=self.size_multiple)
            self._unpack = QwenImagePipeline._unpack_latents  # the pipeline's own inverse of its packing
        if stage in ("full", "encode", "denoise"):
            skip: dict[str, Any] = {"vae": None}
            if stage == "encode":
                skip["transformer"] = None
            elif stage == "denoise":
                skip.update(text_encoder=None, tokenizer=None)
            self._pipe = QwenImagePipeline.from_pretrained(path, dtype=dtype, **skip)
            self._pipe.to(self.device)
            self._pipe.vae_scale_factor = vae_scale_factor  # it assumes 8 when built without its VAE
            self._pipe.set_progress_bar_config(disable=True)

    def stats(self) -> dict[str, Any]:
        # device: where the weights went ('auto' resolves at load), so an operator (and the GPU test)
        # can see a replica that Ray gave a GPU actually uses it.
        return {"waiting_or_running": self._pending, "served": self._served, "device": self.device}

    async def _abort(self, handles: list[threading.Event]) -> None:
        for cancelled in handles:
            cancelled.set()

    # ---- requests ------------------------------------------------------------------------------
    def image_params(self, request: StageRequest) -> ResolvedImageParams:
        """The request's image parameters (or this stage's defaults), checked against this model."""
        return resolve_image_params(request, self.args, self.size_multiple)

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        stage = self.args.pipeline_stage
        cancelled = threading.Event()
        job: Callable[[], HandoffPayload | list[np.ndarray]]  # what each stage's job returns
        if stage == "encode":
            params = self.image_params(request)  # fail before the work, not two stages later
            job = partial(self._encode_job, prompt_of(request), params.negative_prompt)
        elif stage == "full":
            job = partial(self._full_job, prompt_of(request), self.image_params(request), cancelled)
        elif stage == "denoise":
            params = self.image_params(request)
            job = partial(self._denoise_job, _expect(handoff, PROMPT_KIND, self.stage_name), params, cancelled)
        else:
            job = partial(self._decode_job, _expect(handoff, LATENTS_KIND, self.stage_name))
        self._pending += 1
        # Cancelled while queued: the executor drops the job. Running: the ladder aborts the call, which
        # sets ``cancelled``, and the denoising loop stops at its next step.
        try:
            with self.calls.track(request.request_id, cancelled) as call:
                result: HandoffPayload | list[np.ndarray] = await asyncio.get_running_loop().run_in_executor(
                    self._worker, job
                )
                call.finish()
        finally:
            self._pending -= 1
        self._served += 1
        if isinstance(result, HandoffPayload):
            yield StageOutput(stage=self.stage_name, handoff=result, finished=True, finish_reason=FinishReason.STOP)
        else:
            yield StageOutput(stage=self.stage_name, images=result, finished=True, finish_reason=FinishReason.STOP)

    # ---- model work (worker thread only) -------------------------------------------------------
    def _full_job(self, prompt: str, params: ResolvedImageParams, cancelled: threading.Event) -> list[np.ndarray]:
        embeds = self._encode_job(prompt, params.negative_prompt)
        return self._decode_job(self._denoise_job(embeds, params, cancelled))

    def _encode_job(self, prompt: str, negative_prompt: str | None) -> HandoffPayload:
        tensors = self._encode_text(prompt, "")
        if negative_prompt is not None:  # true CFG needs the negative prompt's embeddings too
            tensors.update(self._encode_text(negative_prompt, "negative_"))
        arrays, dtypes = handoffs.arrays(tensors)
        return HandoffPayload(kind=PROMPT_KIND, tensors=arrays, meta={"dtypes": dtypes})

    def _encode_text(self, text: str, prefix: str) -> dict[str, Any]:
        import torch

        with torch.inference_mode():
            embeds, mask = self._pipe.encode_prompt(
                prompt=text, device=self.device, max_sequence_length=self.args.max_sequence_length
            )
        if mask is None:  # the pipeline drops an all-valid mask; send it explicitly
            mask = torch.ones(embeds.shape[:2], dtype=torch.long)
        return {f"{prefix}prompt_embeds": embeds, f"{prefix}prompt_embeds_mask": mask.long()}

    def _denoise_job(
        self, embeds: HandoffPayload, params: ResolvedImageParams, cancelled: threading.Event
    ) -> HandoffPayload:
        import torch

        pipe = self._pipe
        dtype = pipe.transformer.dtype

        def tensor(name: str) -> Any:
            return handoffs.tensor(embeds, name, self.device) if name in embeds.tensors else None

        pacer = StepPacer(self.args.min_step_s, cancelled)  # the first step counts from here

        def step_end(_pipe: Any, _step: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            pacer.step_done()  # paced (min_step_s), then stopped if cancelled
            if cancelled.is_set():
                raise _Cancelled(f"stage {self.stage_name}: request cancelled")
            return kwargs

        negative = tensor("negative_prompt_embeds")
        true_cfg = params.guidance_scale > 1.0 and negative is not None
        seed = params.seed or 0
        generators = [torch.Generator("cpu").manual_seed((seed + i) % SEED_MOD) for i in range(params.n)]
        with torch.inference_mode():
            latents = pipe(
                prompt_embeds=tensor("prompt_embeds").to(dtype),
                prompt_embeds_mask=tensor("prompt_embeds_mask"),
                negative_prompt_embeds=negative.to(dtype) if true_cfg else None,
                negative_prompt_embeds_mask=tensor("negative_prompt_embeds_mask") if true_cfg else None,
                true_cfg_scale=params.guidance_scale if true_cfg else 1.0,
                width=params.width,
                height=params.height,
                num_inference_steps=params.num_inference_steps,
                num_images_per_prompt=params.n,
                generator=generators,
                max_sequence_length=self.args.max_sequence_length,
                output_type="latent",
                callback_on_step_end=step_end,
            ).images
        arrays, dtypes = handoffs.arrays({"latents": latents})
        return HandoffPayload(
            kind=LATENTS_KIND, tensors=arrays, meta={"width": params.width, "height": params.height, "dtypes": dtypes}
        )

    def _decode_job(self, payload: HandoffPayload) -> list[np.ndarray]:
        import torch

        vae = self._vae
        width, height = int(payload.meta["width"]), int(payload.meta["height"])
        packed = handoffs.tensor(payload, "latents")
        with torch.inference_mode():
            latents = self._unpack(packed, height, width, self.size_multiple // 2).to(self.device, vae.dtype)
            shape = (1, vae.config.z_dim, 1, 1, 1)
            mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
            std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
            frames = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]  # [n, 3, H, W] in [-1, 1]
            pixels = self._image_processor.postprocess(frames.float(), output_type="np")  # [n, H, W, 3] in [0, 1]
        return [np.ascontiguousarray((image * 255).round().astype(np.uint8)) for image in pixels]


class _Cancelled(Exception):
    """Raised inside the denoising loop when the request was cancelled."""


def _expect(handoff: HandoffPayload | None, kind: str, stage: str) -> HandoffPayload:
    if handoff is None or handoff.kind != kind:
        got = "nothing" if handoff is None else f"'{handoff.kind}'"
        raise EngineError(f"stage {stage}: expected a '{kind}' handoff, got {got}; check the graph's stage order")
    return handoff


FAMILY = Family(EngineArgs, create)
