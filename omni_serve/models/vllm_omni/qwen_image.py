"""Qwen-Image (vLLM-Omni's ``QwenImagePipeline`` and ``QwenImageEditPipeline``, lone DiTs): how an image request maps
onto them, as vLLM-Omni's ``/v1/images/generations`` maps its body for Qwen-Image.

Size -> ``width``/``height``, steps -> ``num_inference_steps``, ``n`` -> ``num_outputs_per_prompt``, ``seed`` ->
``seed``, and the true-CFG scale -> ``true_cfg_scale`` (Qwen-Image's pipeline reads ``guidance_scale`` only for
guidance-distilled transformers). The negative prompt is sent only when true CFG runs (scale > 1), exactly as the
``diffusers`` family decides, because vLLM-Omni's Qwen-Image falls back to ``true_cfg_scale=4.0`` whenever a
negative prompt is present. The seed goes to a CPU ``torch.Generator`` (``generator_device="cpu"``, honoured by
vLLM-Omni's model runner), so a seed gives the same image on any GPU; the ``n`` images of a request draw in turn
from that one generator and differ. Sizes must be multiples of 16 (an 8x VAE and 2x2 latent patches): vLLM-Omni
would silently round them down, here they are rejected.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omni_serve.models.image_params import SEED_MOD, ResolvedImageParams
from omni_serve.models.vllm_omni.hooks import ImageDitHooks


def request_fields(prompt: str, params: ResolvedImageParams) -> tuple[dict[str, Any], dict[str, Any]]:
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
        "seed": (params.seed or 0) % SEED_MOD,
        "generator_device": "cpu",
        # Ask for the engine's "admitted by the scheduler" event (waiting -> running in stats()).
        "emit_request_lifecycle": True,
    }
    return text_prompt, sampling


QWEN_IMAGE = ImageDitHooks(size_multiple=16, request_fields=request_fields)
# The same mapping; each request carries the image to edit (/v1/images/edits, a chat image part).
QWEN_IMAGE_EDIT = dataclasses.replace(QWEN_IMAGE, edits=True)
