"""The tiny random-weight Qwen-Image checkpoints: the real diffusers classes at toy sizes.

``QwenImagePipeline`` with its MMDiT (``QwenImageTransformer2DModel``), its video-style
VAE (``AutoencoderKLQwenImage``), a Qwen2.5-VL text encoder and a flow-matching
scheduler, so every diffusion serving path (one stage, or encode -> denoise -> decode)
runs on a CPU in well under a second without a model hub. Built deterministically
(fixed seed) on first use and cached under ``$OMNI_SERVE_CACHE/tiny-qwen-image``.

Real Qwen-Image facts kept: 16 latent channels, VAE downsampling 8 (so sizes are
multiples of 16 after the transformer's 2x2 patching), 3-axis RoPE over
(frame, height, width), true CFG with a negative prompt, the ChatML prompt template.
The tokenizer is the byte-level one of :mod:`omni_serve.checkpoints.tiny_omni` (any UTF-8 prompt works).

``tiny-qwen-image-edit`` is the same weights as a ``QwenImageEditPipeline`` (Qwen-Image-Edit's layout: a
``processor`` for the text encoder's vision tower, which reads the source image beside the instruction),
served by vLLM-Omni's diffusion engine for ``/v1/images/edits``.
"""

from __future__ import annotations

import json
import os
import pathlib

from omni_serve.checkpoints import resolve
from omni_serve.checkpoints.cache import ensure_checkpoint

TINY_NAME = "tiny-qwen-image"
TINY_EDIT_NAME = "tiny-qwen-image-edit"  # the same weights as a Qwen-Image-Edit pipeline (image + instruction in)
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 1
_MARKER = "omni_serve_tiny.json"
_SEED = 4321

TEXT_HIDDEN = 32  # = the transformer's joint_attention_dim
LATENT_CHANNELS = 16  # as in Qwen-Image


def _text_encoder_config():
    from transformers import Qwen2_5_VLConfig

    from omni_serve.checkpoints.tiny_omni import TOKEN_IDS, VOCAB_SIZE

    head_dim = 16
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": TEXT_HIDDEN // head_dim,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            # sum(mrope_section) must be head_dim / 2.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": TOKEN_IDS["<|endoftext|>"],
            "eos_token_id": TOKEN_IDS["<|im_end|>"],
            "pad_token_id": TOKEN_IDS["<|endoftext|>"],
            "initializer_range": 0.2,
        },
        # The vision tower is always built; it never runs for text-to-image.
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN,
            "fullatt_block_indexes": [0],
        },
        image_token_id=TOKEN_IDS["<|image_pad|>"],
        video_token_id=TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=TOKEN_IDS["<|vision_end|>"],
    )


def _components() -> dict:
    """The pipeline's parts (weights from the fixed seed): the same for the generation and the edit checkpoint."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from omni_serve.checkpoints.tiny_omni import build_byte_tokenizer

    # A private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config()).eval()
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=LATENT_CHANNELS * 4,
            out_channels=LATENT_CHANNELS,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=TEXT_HIDDEN,
            axes_dims_rope=(4, 6, 6),  # sum = attention_head_dim
        ).eval()
        vae = AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=LATENT_CHANNELS,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],  # 3 stages -> spatial factor 8
        ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": build_byte_tokenizer(),
        "transformer": transformer,
    }


def build_tiny_qwen_image(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny pipeline (``save_pretrained`` layout) to ``path``."""
    from diffusers import QwenImagePipeline

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    QwenImagePipeline(**_components()).save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"name": TINY_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def build_tiny_qwen_image_edit(path: str | os.PathLike) -> pathlib.Path:
    """The edit checkpoint: the same parts as a ``QwenImageEditPipeline``, plus the processor its text encoder
    reads the source image with (Qwen2-VL's: 14 px patches merged 2x2, the image at 4-64 merged patches)."""
    from diffusers import QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    parts = _components()
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64),
        video_processor=Qwen2VLVideoProcessor(),  # never used; the processor class needs one
        tokenizer=parts["tokenizer"],
        chat_template=parts["tokenizer"].chat_template,
    )
    QwenImageEditPipeline(**parts, processor=processor).save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"name": TINY_EDIT_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def ensure_tiny_qwen_image(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny Qwen-Image checkpoint, built on first use (:mod:`omni_serve.checkpoints.cache`)."""
    return ensure_checkpoint(TINY_NAME, build_tiny_qwen_image, _MARKER, BUILD_VERSION, cache_dir)


def ensure_tiny_qwen_image_edit(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny Qwen-Image-Edit checkpoint, built on first use."""
    return ensure_checkpoint(TINY_EDIT_NAME, build_tiny_qwen_image_edit, _MARKER, BUILD_VERSION, cache_dir)


def resolve_model(model: str) -> str:
    """``"tiny"`` -> this checkpoint's cached path (other registered names theirs); anything else unchanged."""
    return resolve(model, tiny=TINY_NAME)
