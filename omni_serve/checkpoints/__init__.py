"""Tiny random-weight checkpoints, built locally on first use and cached: one registry, one CLI.

Each is a real architecture at toy sizes, built deterministically (fixed seed) by its module and
cached by :mod:`omni_serve.checkpoints.cache` (``$OMNI_SERVE_CACHE``, else ``~/.cache/omni_serve``).
A graph's ``engine_args.model`` may name one; engines turn the name into the cached path with
:func:`resolve` and leave any other model (hub id, local path) unchanged. ``tiny`` is each engine
family's own tiny checkpoint (the ``tiny`` argument of :func:`resolve`).

    python -m omni_serve.checkpoints NAME [--cache-dir DIR]   # builds it if needed, prints its path

Builders import torch, transformers or diffusers: they are imported only when one is built.
"""

from __future__ import annotations

import importlib
import os
import pathlib
from dataclasses import dataclass

__all__ = ["CHECKPOINTS", "TinyCheckpoint", "ensure", "resolve"]


@dataclass(frozen=True)
class TinyCheckpoint:
    """One registered checkpoint: its name and the function that returns its cached path, building it first."""

    name: str
    module: str  # the module that builds it
    ensure: str  # its ``(cache_dir=None) -> pathlib.Path`` function
    about: str

    def path(self, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
        return getattr(importlib.import_module(self.module), self.ensure)(cache_dir)


CHECKPOINTS: dict[str, TinyCheckpoint] = {
    c.name: c
    for c in (
        TinyCheckpoint(
            "tiny-qwen3-omni",
            "omni_serve.checkpoints.tiny_omni",
            "ensure_tiny_omni",
            "Qwen3-Omni (thinker, talker, code2wav) for the transformers and vllm_omni engines",
        ),
        TinyCheckpoint(
            "tiny-qwen-image",
            "omni_serve.checkpoints.tiny_image",
            "ensure_tiny_qwen_image",
            "Qwen-Image (diffusers layout) for the diffusers and vllm_omni_diffusion engines",
        ),
        TinyCheckpoint(
            "tiny-qwen-image-edit",
            "omni_serve.checkpoints.tiny_image",
            "ensure_tiny_qwen_image_edit",
            "Qwen-Image-Edit (the same weights, image + instruction in) for the vllm_omni_diffusion engine",
        ),
        TinyCheckpoint(
            "tiny-qwen3", "omni_serve.checkpoints.tiny_llm", "ensure_tiny_qwen3", "Qwen3 text LLM for the vllm engine"
        ),
        TinyCheckpoint(
            "tiny-wan2.2-ti2v",
            "omni_serve.checkpoints.tiny_wan",
            "ensure_tiny_wan",
            "Wan 2.2 TI2V text-to-video (diffusers layout) for the vllm_omni_diffusion engine",
        ),
        TinyCheckpoint(
            "tiny-hunyuan-video-1.5",
            "omni_serve.checkpoints.tiny_hunyuan_video_15",
            "ensure_tiny_hunyuan_video_15",
            "HunyuanVideo-1.5 text-to-video (diffusers layout) for the vllm_omni_diffusion engine",
        ),
        TinyCheckpoint(
            "tiny-hunyuan-video-1.5-i2v",
            "omni_serve.checkpoints.tiny_hunyuan_video_15",
            "ensure_tiny_hunyuan_video_15_i2v",
            "HunyuanVideo-1.5 image-to-video (the same weights, plus SigLIP) for the vllm_omni_diffusion engine",
        ),
        TinyCheckpoint(
            "tiny-glm-image",
            "omni_serve.checkpoints.tiny_glm_image",
            "ensure_tiny_glm_image",
            "GLM-Image autoregressive -> DiT (AR + DiT, diffusers layout) for native vLLM-Omni (its oracle)",
        ),
        TinyCheckpoint(
            "tiny-qwen3-tts",
            "omni_serve.checkpoints.tiny_qwen3_tts",
            "ensure_tiny_qwen3_tts",
            "Qwen3-TTS (talker, speech tokenizer) for vLLM-Omni's qwen3_tts pipeline",
        ),
        TinyCheckpoint(
            "tiny-voxtral-tts",
            "omni_serve.checkpoints.tiny_voxtral_tts",
            "ensure_tiny_voxtral_tts",
            "Voxtral TTS (Mistral LM, acoustic transformer, audio tokenizer) for vLLM-Omni's voxtral_tts pipeline",
        ),
        TinyCheckpoint(
            "tiny-ming-flash-omni",
            "omni_serve.checkpoints.tiny_ming_flash_omni",
            "ensure_tiny_ming_flash_omni",
            "Ming-flash-omni 2.0 (MoE thinker, talker with CFM and AudioVAE) for vLLM-Omni's ming_flash_omni pipeline",
        ),
        TinyCheckpoint(
            "tiny-qwen2.5-omni",
            "omni_serve.checkpoints.tiny_qwen2_5_omni",
            "ensure_tiny_qwen2_5_omni",
            "Qwen2.5-Omni (thinker, talker, token2wav: DiT and BigVGAN) for vLLM-Omni's qwen2_5_omni pipeline",
        ),
    )
}
TINY = "tiny"  # the alias an engine family maps to its own tiny checkpoint
DEFAULT_TINY = "tiny-qwen3-omni"  # what ``tiny`` names where no family says otherwise (the CLI)


def ensure(name: str, cache_dir: str | os.PathLike | None = None, tiny: str = DEFAULT_TINY) -> pathlib.Path:
    """The cached path of registered checkpoint ``name`` (or ``tiny``), built on first use; KeyError if unknown."""
    name = tiny if name == TINY else name
    if name not in CHECKPOINTS:
        raise KeyError(f"no tiny checkpoint named {name!r} (known: {', '.join([TINY, *CHECKPOINTS])})")
    return CHECKPOINTS[name].path(cache_dir)


def resolve(name_or_path: str, tiny: str = DEFAULT_TINY, cache_dir: str | os.PathLike | None = None) -> str:
    """A registered name (or ``tiny``, meaning checkpoint ``tiny``) -> its cached path; anything else unchanged."""
    if name_or_path == TINY or name_or_path in CHECKPOINTS:
        return str(ensure(name_or_path, cache_dir, tiny))
    return name_or_path
