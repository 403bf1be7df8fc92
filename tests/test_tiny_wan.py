"""The tiny Wan 2.2 TI2V checkpoint: the real diffusers classes in TI2V-5B's layout, deterministic, served by
the layout vLLM-Omni's ``wan2_2_ti2v`` pipeline reads; diffusers itself makes a video of it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from omni_serve import checkpoints
from omni_serve.checkpoints import tiny_wan


def _weights(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*.safetensors"))}


def test_build_is_deterministic_and_has_ti2v_5b_layout(tmp_path: Path) -> None:
    import torch
    from diffusers import WanPipeline

    first = tiny_wan.build_tiny_wan(tmp_path / "a")
    second = tiny_wan.build_tiny_wan(tmp_path / "b")
    assert _weights(first) == _weights(second) and len(_weights(first)) == 3  # text encoder, transformer, VAE
    index = json.loads((first / "model_index.json").read_text())
    # What vLLM-Omni's Wan22Pipeline reads to serve it as TI2V: one transformer, expand_timesteps.
    assert index["_class_name"] == "WanPipeline" and index["expand_timesteps"] is True
    assert index["transformer_2"] == [None, None] and not (first / "transformer_2").exists()
    vae = json.loads((first / "vae" / "config.json").read_text())
    assert (vae["z_dim"], vae["patch_size"], vae["is_residual"]) == (48, 2, True)
    assert (vae["scale_factor_spatial"], vae["scale_factor_temporal"]) == (16, 4)

    # diffusers loads a Wan transformer (it keeps some modules in fp32) only through accelerate, which the
    # project does not install: build it from its saved config and load its saved weights.
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    transformer = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(first / "transformer"))
    [weights] = (first / "transformer").glob("*.safetensors")
    transformer.load_state_dict(load_file(weights), strict=True)
    pipe = WanPipeline.from_pretrained(first, transformer=transformer)
    assert type(pipe.text_encoder).__name__ == "UMT5EncoderModel"
    assert pipe.transformer.config.in_channels == 48 and tuple(pipe.transformer.config.patch_size) == (1, 2, 2)
    video = pipe(
        "a red fox",
        height=64,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames[0]
    assert video.shape == (5, 64, 32, 3) and np.isfinite(video).all()


def test_registered_for_the_cli() -> None:
    entry = checkpoints.CHECKPOINTS[tiny_wan.TINY_NAME]
    assert (entry.module, entry.ensure) == ("omni_serve.checkpoints.tiny_wan", "ensure_tiny_wan")
