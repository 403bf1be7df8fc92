"""The tiny Qwen-Image checkpoint: real diffusers classes, deterministic, built once under a lock."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

from omni_serve.checkpoints import tiny_image


def _weights(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*.safetensors"))}


def test_build_is_deterministic_and_loads_with_diffusers(tmp_path: Path) -> None:
    from diffusers import QwenImagePipeline

    first = tiny_image.build_tiny_qwen_image(tmp_path / "a")
    second = tiny_image.build_tiny_qwen_image(tmp_path / "b")
    assert _weights(first) == _weights(second) and len(_weights(first)) == 3  # text encoder, transformer, VAE
    pipe = QwenImagePipeline.from_pretrained(first)
    assert type(pipe.transformer).__name__ == "QwenImageTransformer2DModel"
    assert type(pipe.vae).__name__ == "AutoencoderKLQwenImage"
    assert type(pipe.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert pipe.vae_scale_factor == 8 and pipe.transformer.config.in_channels == 4 * tiny_image.LATENT_CHANNELS
    assert pipe.tokenizer.decode(pipe.tokenizer("un renard roux 🦊").input_ids) == "un renard roux 🦊"


def test_ensure_builds_once_for_concurrent_callers_and_rebuilds_stale(tmp_path: Path) -> None:
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: tiny_image.ensure_tiny_qwen_image(tmp_path), range(3)))
    target = tmp_path / tiny_image.TINY_NAME
    assert paths == [target] * 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{tiny_image.TINY_NAME}.build-")]
    marker = target / "omni_serve_tiny.json"
    built = marker.stat().st_mtime_ns
    assert tiny_image.ensure_tiny_qwen_image(tmp_path) == target and marker.stat().st_mtime_ns == built  # cached

    marker.write_text(json.dumps({"name": tiny_image.TINY_NAME, "version": -1}))
    assert tiny_image.ensure_tiny_qwen_image(tmp_path) == target
    assert json.loads(marker.read_text())["version"] == tiny_image.BUILD_VERSION
