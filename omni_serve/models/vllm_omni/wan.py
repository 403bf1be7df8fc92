"""Wan 2.2 (vLLM-Omni's ``WanPipeline``, pipeline ``wan2_2_ti2v``, a lone video DiT): how its checkpoint sizes a
video. vLLM-Omni's Wan pipeline rounds a size to its VAE's spatial factor times its transformer's spatial patch,
and a frame count to the VAE's temporal factor; omni_serve reads both from the diffusers-layout configs and refuses
other sizes with a 400 (``video_params``)."""

from __future__ import annotations

import json
import pathlib

from omni_serve.exceptions import EngineError
from omni_serve.models.vllm_omni.hooks import PipelineHooks, VideoDitHooks


def multiples(model_path: str) -> tuple[int, int]:
    """(size multiple, frame multiple) of a diffusers-layout Wan checkpoint directory."""
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


WAN = VideoDitHooks(multiples=multiples)
# The pipeline wan2_2_ti2v: the checkpoint its generated graph serves unless told another.
WAN2_2_TI2V = PipelineHooks(reference_model="Wan-AI/Wan2.2-TI2V-5B-Diffusers")
