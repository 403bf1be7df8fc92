"""The tiny random-weight HunyuanVideo-1.5 checkpoints: the real classes at toy sizes, text-to-video and image-to-video.

``HunyuanVideo15Pipeline`` as ``hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v`` lays it out, which
vLLM-Omni serves as its ``hunyuan_video_15`` pipeline (its own ``HunyuanVideo15Pipeline``): a
``HunyuanVideo15Transformer3DModel`` (diffusers' weights, loaded into vLLM-Omni's own class), the causal video VAE
(``AutoencoderKLHunyuanVideo15``: 16x spatial and 4x temporal compression in five stages), a Qwen2.5-VL text
encoder (``Qwen2_5_VLTextModel``, with a ``Qwen2Tokenizer`` and its chat template), the byT5 glyph encoder
(``T5EncoderModel``, ``ByT5Tokenizer``), a flow-matching Euler scheduler and diffusers' guider. The transformer's
patch is 1x1x1, so sizes are multiples of 16 and frame counts 4k + 1, as in the real model.

``tiny-hunyuan-video-1.5-i2v`` is the same weights as ``HunyuanVideo15ImageToVideoPipeline`` (the ``..._i2v``
repositories' layout), plus the SigLIP image encoder and its processor: vLLM-Omni picks its image-to-video class
from ``model_index.json``, one class per checkpoint.

Toy sizes, except where vLLM-Omni's code fixes a width: the glyph projection's 2048-wide middle layer
(``HunyuanVideo15ByT5TextProjection``) and the 1152-wide image embeddings (the text-to-video pipeline feeds
zeros of ``vision_states_dim = 1152``; SigLIP so400m's width) stay real-size, at one SigLIP layer. The VAE has
8 latent channels, not 32: its narrowest stage must hold twice the latent channels, and 32 would make it 4M
parameters; the transformer still takes 2 x latent + 1 channels (noise, image condition, mask). Weights are saved in
bfloat16 (about 12 MB text-to-video, 24 MB image-to-video; vLLM-Omni loads each part at the engine's dtype). The
tokenizer is the byte-level one of :mod:`omni_serve.checkpoints.tiny_omni`: vLLM-Omni crops the first 108 tokens
of the chat template (the real tokenizer's system message), here bytes of it, and the prompt stays in.
Built deterministically (fixed seed) on first use and cached under ``$OMNI_SERVE_CACHE``.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from omni_serve.checkpoints.cache import ensure_checkpoint

TINY_NAME = "tiny-hunyuan-video-1.5"
TINY_I2V_NAME = "tiny-hunyuan-video-1.5-i2v"  # the same weights as an image-to-video pipeline (+ SigLIP)
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 1
_MARKER = "omni_serve_tiny.json"
_SEED = 1505

TEXT_DIM = 32  # the Qwen2.5-VL text encoder's hidden size = the transformer's text_embed_dim
GLYPH_DIM = 32  # the byT5 encoder's d_model = the transformer's text_embed_2_dim
IMAGE_DIM = 1152  # fixed by vLLM-Omni: vision_states_dim (SigLIP so400m's width) = image_embed_dim
LATENT_CHANNELS = 8
BYT5_VOCAB = 384  # ByT5Tokenizer's ids: 3 specials, 256 bytes, 125 extra ids
SIGLIP_IMAGE, SIGLIP_PATCH = 8, 4  # 2x2 patches: 4 image tokens (so400m: 384 / 14 -> 729)


def _qwen2_tokenizer() -> Any:
    """The byte-level tokenizer as the ``Qwen2Tokenizer`` the real layout names (vLLM-Omni loads that class), with
    the ChatML template vLLM-Omni applies to every prompt."""
    from transformers import Qwen2Tokenizer

    from omni_serve.checkpoints.tiny_omni import build_byte_tokenizer

    byte_level = build_byte_tokenizer()
    tokenizer = Qwen2Tokenizer(
        tokenizer_object=byte_level.backend_tokenizer,
        eos_token=byte_level.eos_token,
        pad_token=byte_level.pad_token,
        model_max_length=2048,  # vLLM-Omni pads every prompt to 1000 + 108 tokens
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = byte_level.chat_template
    return tokenizer


def _text_encoders() -> dict[str, Any]:
    """The Qwen2.5-VL text model (vLLM-Omni reads its third-to-last hidden state: three layers, so one of them
    counts) and the byT5 glyph encoder, with their tokenizers."""
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from omni_serve.checkpoints.tiny_omni import TOKEN_IDS, VOCAB_SIZE

    head_dim = 16
    text = Qwen2_5_VLTextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=TEXT_DIM,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=TEXT_DIM // head_dim,
        num_key_value_heads=1,
        max_position_embeddings=2048,  # vLLM-Omni pads every prompt to 1108 tokens
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},  # sum: head/2
        bos_token_id=TOKEN_IDS["<|endoftext|>"],
        eos_token_id=TOKEN_IDS["<|im_end|>"],
        pad_token_id=TOKEN_IDS["<|endoftext|>"],
    )
    glyph = T5Config(
        vocab_size=BYT5_VOCAB,
        d_model=GLYPH_DIM,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        feed_forward_proj="gated-gelu",  # byT5's
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return {
        "tokenizer": _qwen2_tokenizer(),
        "text_encoder": Qwen2_5_VLTextModel(text).eval(),
        "tokenizer_2": ByT5Tokenizer(),
        "text_encoder_2": T5EncoderModel(glyph).eval(),
    }


def _transformer_and_vae(task_type: str) -> dict[str, Any]:
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1,  # noisy latents, condition latents, condition mask
        out_channels=LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=2,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=GLYPH_DIM,
        image_embed_dim=IMAGE_DIM,
        rope_axes_dim=(4, 6, 6),  # sum = attention_head_dim
        task_type=task_type,
    ).eval()
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT_CHANNELS,
        block_out_channels=(8, 8, 8, 16, 16),  # five stages: 2^4 = 16x in space, the last two also 2x in time
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
    ).eval()
    return {"transformer": transformer, "vae": vae}


def _image_encoder() -> dict[str, Any]:
    """SigLIP at the real width (see the module's docstring), one layer, 4 image tokens; no pooling head (vLLM-Omni
    reads ``last_hidden_state``)."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(
        hidden_size=IMAGE_DIM,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=16,
        image_size=SIGLIP_IMAGE,
        patch_size=SIGLIP_PATCH,
        vision_use_head=False,
    )
    processor = SiglipImageProcessor(size={"height": SIGLIP_IMAGE, "width": SIGLIP_IMAGE})
    return {"image_encoder": SiglipVisionModel(config).eval(), "feature_extractor": processor}


def _components(task_type: str) -> dict[str, Any]:
    """Every part, weights from the fixed seed in a fixed order (so both checkpoints share them), in bfloat16."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance

    # A private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        parts = {**_text_encoders(), **_transformer_and_vae(task_type), **_image_encoder()}
    for part in parts.values():
        if isinstance(part, torch.nn.Module):
            # torch's own ``to``: diffusers' warns about modules to keep in float32, and these models list none.
            torch.nn.Module.to(part, torch.bfloat16)
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)  # 480p's shift
    parts["guider"] = ClassifierFreeGuidance(guidance_scale=6.0)
    return parts


def _write(out: pathlib.Path, pipe: Any, name: str) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"name": name, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def build_tiny_hunyuan_video_15(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny text-to-video pipeline (``save_pretrained`` layout) to ``path``."""
    from diffusers import HunyuanVideo15Pipeline

    parts = _components("t2v")
    del parts["image_encoder"], parts["feature_extractor"]  # the text-to-video layout has none
    return _write(pathlib.Path(path), HunyuanVideo15Pipeline(**parts), TINY_NAME)


def build_tiny_hunyuan_video_15_i2v(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny image-to-video pipeline (the same weights, plus SigLIP) to ``path``."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    pipe = HunyuanVideo15ImageToVideoPipeline(**_components("i2v"))
    return _write(pathlib.Path(path), pipe, TINY_I2V_NAME)


def ensure_tiny_hunyuan_video_15(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny HunyuanVideo-1.5 text-to-video checkpoint, built on first use."""
    return ensure_checkpoint(TINY_NAME, build_tiny_hunyuan_video_15, _MARKER, BUILD_VERSION, cache_dir)


def ensure_tiny_hunyuan_video_15_i2v(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny HunyuanVideo-1.5 image-to-video checkpoint, built on first use."""
    return ensure_checkpoint(TINY_I2V_NAME, build_tiny_hunyuan_video_15_i2v, _MARKER, BUILD_VERSION, cache_dir)
