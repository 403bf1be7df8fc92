"""The tiny random-weight GLM-Image checkpoint: the real transformers and diffusers classes, toy sizes, real ids.

GLM-Image is an autoregressive -> DiT image model: an AR stage (``GlmImageForConditionalGeneration``, a
GLM-4 text model with a vision encoder and a VQ tokenizer of images) writes a grid of image tokens, and
a DiT (``GlmImageTransformer2DModel`` + ``AutoencoderKL``, a T5 glyph encoder with ByT5's tokenizer)
draws the image from them. vLLM-Omni serves it as its ``glm_image`` pipeline: stage 0 (``ar``, LLM_AR,
from ``vision_language_encoder/``, tokenizer from ``processor/``) -> stage 1 (``dit``, DIFFUSION), the
handoff being the AR's token ids (``stage_input_processors.glm_image.ar2diffusion``). The layout here is
``zai-org/GLM-Image``'s (diffusers' ``GlmImagePipeline.save_pretrained``).

Real facts kept, because vLLM-Omni and transformers hard-code them: the text vocabulary of 168064 ids
whose first 16512 are image tokens (the AR's head has those 16512 outputs), ``<|begin_of_image|>`` 16384
(the image bos the prompt ends with), ``<|end_of_image|>`` 16385 (the AR's EOS), the VQ codebook of 16384,
and GLM-4's text special tokens shifted by those 16512 (``<|endoftext|>`` 167841 and ``<|image|>`` 167855
are the config defaults; ``<sop>`` / ``<eop>``, the grid markers of the generation scaffold, 167845 /
167846 by the same shift). The 256 bytes take the first text ids (16512-16767), every other id is a
filler word, as in :mod:`omni_serve.checkpoints.tiny_omni`. Sizes: the DiT's 2x2 patch on an 8x VAE makes
16 px a DiT token, and the AR's image tokens are 32 px (upsampled 2x for the DiT), so sizes are
multiples of 32; the vision encoder reads an edit's source image in 32 px patches (one VQ token each).

Built deterministically (fixed seed) on first use and cached under ``$OMNI_SERVE_CACHE/tiny-glm-image``.
"""

from __future__ import annotations

import json
import os
import pathlib

from omni_serve.checkpoints.cache import ensure_checkpoint

TINY_NAME = "tiny-glm-image"
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 1
_MARKER = "omni_serve_tiny.json"
_SEED = 1616

VOCAB_SIZE = 168064
VISION_VOCAB_SIZE = 16512  # the image tokens at the head of the vocabulary: what the AR stage outputs
GLM4_SHIFT = VISION_VOCAB_SIZE  # GLM-4's text ids moved up past the image tokens
SPECIAL_IDS: dict[str, int] = {
    "<|begin_of_image|>": 16384,
    "<|end_of_image|>": 16385,
    "<|endoftext|>": 151329 + GLM4_SHIFT,  # 167841: GlmImageTextConfig's pad_token_id
    "[gMASK]": 151331 + GLM4_SHIFT,
    "<sop>": 151333 + GLM4_SHIFT,
    "<eop>": 151334 + GLM4_SHIFT,
    "<|user|>": 151336 + GLM4_SHIFT,
    "<|assistant|>": 151337 + GLM4_SHIFT,
    "<|image|>": 151343 + GLM4_SHIFT,  # 167855: GlmImageConfig's image_token_id
}
# GLM-4's turn format; an image is its begin/end markers around the placeholder the processor expands.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{- '<|begin_of_image|><|image|><|end_of_image|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
# px per vision-encoder patch: one VQ image token per patch, on the AR's 32 px grid (an edit's source image
# is read on that grid and upsampled 2x for the DiT, like the AR's own tokens).
VISION_PATCH = 32


def build_glm_tokenizer():
    """The tiny GLM-Image text tokenizer: bytes at the first text ids, GLM-Image's special ids, fillers elsewhere."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from omni_serve.checkpoints.tiny_omni import _byte_level_tokenizer, _check_ids, filler_word

    byte_chars = bytes_to_unicode()
    named = {token_id: token for token, token_id in SPECIAL_IDS.items()}
    vocab: dict[str, int] = {}
    for token_id in range(VOCAB_SIZE):
        if GLM4_SHIFT <= token_id < GLM4_SHIFT + 256:
            vocab[byte_chars[token_id - GLM4_SHIFT]] = token_id
        else:
            vocab[named.get(token_id) or filler_word(token_id)] = token_id
    tok = _byte_level_tokenizer(vocab, [(token, True) for token in SPECIAL_IDS])
    _check_ids(tok, SPECIAL_IDS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_image|>",  # GlmImageProcessor ends a generation prompt with it
        eos_token="<|end_of_image|>",
        pad_token="<|endoftext|>",
        # What GlmImageProcessor reads off the tokenizer by name.
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"},
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_glm_image(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny pipeline (``save_pretrained`` layout) to ``path``."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
    from transformers import (
        ByT5Tokenizer,
        GlmImageConfig,
        GlmImageForConditionalGeneration,
        GlmImageImageProcessor,
        GlmImageProcessor,
        T5Config,
        T5EncoderModel,
    )

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    glyph_tokenizer = ByT5Tokenizer()  # byte-level: no vocabulary file to build
    processor = GlmImageProcessor(
        image_processor=GlmImageImageProcessor(
            patch_size=VISION_PATCH,
            temporal_patch_size=1,
            merge_size=1,
            size={"shortest_edge": 32 * 32, "longest_edge": 512 * 512},
        ),
        tokenizer=build_glm_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )
    head_dim = 32  # the smallest head vLLM's CPU attention takes
    config = GlmImageConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            "vision_vocab_size": VISION_VOCAB_SIZE,
            "hidden_size": head_dim,  # one head: the 168064-id embedding is most of the checkpoint (21 MB)
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "max_position_embeddings": 8192,
            # 3D RoPE (T, H, W): sum(mrope_section) = head_dim / 2.
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4]},
            "pad_token_id": SPECIAL_IDS["<|endoftext|>"],
            "eos_token_id": SPECIAL_IDS["<|end_of_image|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "num_heads": 2,
            "image_size": 2 * VISION_PATCH,
            "patch_size": VISION_PATCH,
            "intermediate_size": 32,
            "out_hidden_size": 32,
        },
        vq_config={"embed_dim": 32, "num_embeddings": 16384, "latent_channels": 32},
    )
    # A private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        vision_language_encoder = GlmImageForConditionalGeneration(config).eval()
        text_encoder = T5EncoderModel(
            T5Config(
                vocab_size=glyph_tokenizer.vocab_size + len(glyph_tokenizer.get_added_vocab()),
                d_model=32,
                d_kv=16,
                d_ff=64,
                num_layers=2,
                num_heads=2,
                relative_attention_num_buckets=8,
            )
        ).eval()
        transformer = GlmImageTransformer2DModel(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            text_embed_dim=32,
            time_embed_dim=16,
            condition_dim=8,
            prior_vq_quantizer_codebook_size=16384,
        ).eval()
        vae = AutoencoderKL(
            block_out_channels=(4, 8, 16, 16),  # 3 downsamplings: 8x
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=128,
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        ).eval()
    pipe = GlmImagePipeline(
        tokenizer=glyph_tokenizer,
        processor=processor,
        text_encoder=text_encoder,
        vision_language_encoder=vision_language_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    pipe.save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"name": TINY_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def ensure_tiny_glm_image(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny GLM-Image checkpoint, built on first use (:mod:`omni_serve.checkpoints.cache`)."""
    return ensure_checkpoint(TINY_NAME, build_tiny_glm_image, _MARKER, BUILD_VERSION, cache_dir)
