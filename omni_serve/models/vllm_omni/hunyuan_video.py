"""HunyuanVideo-1.5 (vLLM-Omni's ``HunyuanVideo15Pipeline``, pipeline ``hunyuan_video_15``, a lone video DiT; and
``HunyuanVideo15ImageToVideoPipeline``, its image-to-video checkpoints): how a checkpoint sizes a video.

vLLM-Omni's pipelines make latents of ``size // vae.spatial_compression_ratio`` and
``(frames - 1) // vae.temporal_compression_ratio + 1`` and patch them by the transformer's ``patch_size`` (1: the
real model's), so other sizes are floored silently; omni_serve reads both factors from the diffusers-layout configs
and refuses other sizes with a 400 (``video_params``). Image-to-video is its own checkpoint and class (the
``..._i2v`` repositories: SigLIP image encoder, an image-to-video transformer): vLLM-Omni picks the class from
``model_index.json`` and its ``/v1/videos`` hands the request's ``input_reference`` to it as the prompt's
``multi_modal_data["image"]``; a text-to-video checkpoint would ignore an image, so its graph takes none.
"""

from __future__ import annotations

import json
import pathlib

from omni_serve.exceptions import EngineError
from omni_serve.models.vllm_omni.hooks import PipelineHooks, VideoDitHooks


def multiples(model_path: str) -> tuple[int, int]:
    """(size multiple, frame multiple) of a diffusers-layout HunyuanVideo-1.5 checkpoint directory."""
    root = pathlib.Path(model_path)
    try:
        vae = json.loads((root / "vae" / "config.json").read_text())
        transformer = json.loads((root / "transformer" / "config.json").read_text())
        size = int(vae["spatial_compression_ratio"]) * int(transformer["patch_size"])
        return size, int(vae["temporal_compression_ratio"]) * int(transformer["patch_size_t"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EngineError(
            f"{model_path}: cannot read the video sizes from vae/config.json (spatial_compression_ratio, "
            f"temporal_compression_ratio) and transformer/config.json (patch_size, patch_size_t): "
            f"{type(err).__name__}"
        ) from None


HUNYUAN_VIDEO_15 = VideoDitHooks(multiples=multiples)
HUNYUAN_VIDEO_15_I2V = VideoDitHooks(multiples=multiples, image_to_video=True)
# The pipeline hunyuan_video_15: the checkpoint its generated graph serves unless told another (vLLM-Omni's
# supported-models table names it first for HunyuanVideo15Pipeline).
HUNYUAN_VIDEO_15_PIPELINE = PipelineHooks(reference_model="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v")
