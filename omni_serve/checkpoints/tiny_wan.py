"""The tiny random-weight Wan 2.2 TI2V checkpoint: the real diffusers classes at toy sizes.

``WanPipeline`` as ``Wan-AI/Wan2.2-TI2V-5B-Diffusers`` lays it out (diffusers layout, one transformer,
``expand_timesteps``, no ``transformer_2``), which vLLM-Omni serves as its ``wan2_2_ti2v`` pipeline
(``Wan22Pipeline``): a ``WanTransformer3DModel``, the TI2V-5B VAE (``AutoencoderKLWan`` with its
residual 48-channel latent, 2x2 patchified pixels, 16x spatial and 4x temporal compression), a
UMT5 text encoder and a flow-prediction UniPC scheduler. Every size is a toy's; the structure and
the constraints that follow from it are the real model's: sizes are multiples of 32 (16 x the
transformer's 2x2 patch) and frame counts 4k + 1. The tokenizer is the byte-level one of
:mod:`omni_serve.checkpoints.tiny_omni`. Built deterministically (fixed seed) on first use and cached
under ``$OMNI_SERVE_CACHE/tiny-wan2.2-ti2v`` (about 1.5 MB).
"""

from __future__ import annotations

import json
import os
import pathlib

from omni_serve.checkpoints.cache import ensure_checkpoint

TINY_NAME = "tiny-wan2.2-ti2v"
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 1
_MARKER = "omni_serve_tiny.json"
_SEED = 2202

TEXT_DIM = 32  # UMT5's d_model = the transformer's text_dim
LATENT_CHANNELS = 48  # TI2V-5B's VAE latent
PATCH = 2  # the VAE's pixel patchify (3 x 2 x 2 = 12 channels in) and the transformer's spatial patch


def build_tiny_wan(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny pipeline (``save_pretrained`` layout) to ``path``."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from omni_serve.checkpoints.tiny_omni import TOKEN_IDS, VOCAB_SIZE, build_byte_tokenizer

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # A private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=VOCAB_SIZE,
                d_model=TEXT_DIM,
                d_kv=16,
                d_ff=64,
                num_layers=2,
                num_heads=2,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=32,
                pad_token_id=TOKEN_IDS["<|endoftext|>"],
                eos_token_id=TOKEN_IDS["<|im_end|>"],
                decoder_start_token_id=TOKEN_IDS["<|endoftext|>"],
            )
        ).eval()
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=LATENT_CHANNELS,
            in_channels=3 * PATCH * PATCH,
            out_channels=3 * PATCH * PATCH,
            is_residual=True,
            patch_size=PATCH,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],  # 3 stages -> 8x (x 2 patch = 16x) space, 4x time
            scale_factor_spatial=16,
            scale_factor_temporal=4,
            latents_mean=[0.0] * LATENT_CHANNELS,
            latents_std=[1.0] * LATENT_CHANNELS,
        ).eval()
        transformer = WanTransformer3DModel(
            patch_size=(1, PATCH, PATCH),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=LATENT_CHANNELS,
            out_channels=LATENT_CHANNELS,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=64,
        ).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0, num_train_timesteps=1000
    )
    pipe = WanPipeline(
        tokenizer=build_byte_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
        transformer_2=None,
        boundary_ratio=None,
        expand_timesteps=True,  # TI2V: one transformer, the image condition in the first latent frame
    )
    pipe.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"name": TINY_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def ensure_tiny_wan(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny Wan 2.2 TI2V checkpoint, built on first use (:mod:`omni_serve.checkpoints.cache`)."""
    return ensure_checkpoint(TINY_NAME, build_tiny_wan, _MARKER, BUILD_VERSION, cache_dir)
