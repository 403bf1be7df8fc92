"""The tiny random-weight Qwen3-Omni checkpoint and the byte-level tokenizer it uses.

The checkpoint has the real transformers architecture (thinker with audio and vision
towers, talker with its code predictor, code2wav) at toy sizes, so every serving code
path runs on a CPU in milliseconds without a model hub. It is built deterministically
(fixed seed) on first use and cached; several replicas may ask for it at once.

Real Qwen3-Omni facts kept: 16 code groups per codec frame, 1920 samples per frame at
24 kHz (upsampling 8*5*4*3 * 2*2), a talker vocab of codebook + 1024 whose top 1024 ids
hold the codec specials, the ChatML prompt format and the tts/codec special tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from typing import TYPE_CHECKING

from omni_serve.checkpoints import ensure_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TINY_NAME = "tiny-qwen3-omni"
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 2
_MARKER = "omni_serve_tiny.json"
_SEED = 1234

# Token layout: ids 0..255 are the raw bytes, then the role words (single tokens like in the
# real Qwen vocab, so the talker can tell a segment's role from the token after <|im_start|>),
# then the special tokens. The thinker vocab is exactly this size so every sampled id decodes.
ROLE_WORDS = ("system", "user", "assistant")
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
)
TOKEN_IDS: dict[str, int] = {tok: 256 + i for i, tok in enumerate(ROLE_WORDS + SPECIAL_TOKENS)}
VOCAB_SIZE = 256 + len(ROLE_WORDS) + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Codec: ids below CODEBOOK_SIZE are codes; the specials sit in the top-1024 block that HF's
# talker generation suppresses (except EOS), as in the real model (codebook 2048, vocab 3072).
CODEBOOK_SIZE = 128
NUM_CODE_GROUPS = 16
CODEC_IDS = {
    "codec_pad_id": CODEBOOK_SIZE + 4,
    "codec_bos_id": CODEBOOK_SIZE + 5,
    "codec_eos_token_id": CODEBOOK_SIZE + 6,
    "codec_nothink_id": CODEBOOK_SIZE + 11,
    "codec_think_bos_id": CODEBOOK_SIZE + 12,
    "codec_think_eos_id": CODEBOOK_SIZE + 13,
}
SPEAKERS = {"ethan": CODEBOOK_SIZE + 30, "chelsie": CODEBOOK_SIZE + 31, "aiden": CODEBOOK_SIZE + 32}
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte tokens, the ChatML role words and Qwen's special tokens.

    Any UTF-8 text round-trips. Reusable by other tiny models (ids are fixed, see ``TOKEN_IDS``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Added in id order, so ids follow TOKEN_IDS.
    tok.add_tokens([AddedToken(w, normalized=False, special=False) for w in ROLE_WORDS])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    for token, token_id in TOKEN_IDS.items():
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"tokenizer layout drifted: {token!r} has id {tok.token_to_id(token)}")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# 3D RoPE of the thinker and talker; sum(mrope_section) must be head_dim / 2 (head_dim 16).
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "interleaved": True}


def tiny_config():
    """The ``Qwen3OmniMoeConfig`` of the tiny checkpoint."""
    from transformers import Qwen3OmniMoeConfig

    t = TOKEN_IDS
    hidden = 32
    text = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "rope_parameters": _MROPE,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "pad_token_id": t["<|endoftext|>"],
        "eos_token_id": t["<|im_end|>"],
        "initializer_range": 0.2,
    }
    thinker = {
        "text_config": text,
        "audio_config": {
            "num_mel_bins": 16,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "d_model": 16,
            "output_dim": hidden,
            "downsample_hidden_size": 8,
            "max_source_positions": 64,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "patch_size": 4,
            "out_hidden_size": hidden,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        "audio_token_id": t["<|audio_pad|>"],
        "image_token_id": t["<|image_pad|>"],
        "video_token_id": t["<|video_pad|>"],
        "audio_start_token_id": t["<|audio_start|>"],
        "vision_start_token_id": t["<|vision_start|>"],  # read by the code, not declared by the config
        "user_token_id": t["user"],
        "initializer_range": 0.2,
    }
    talker = {
        "text_config": {
            "vocab_size": CODEBOOK_SIZE + 1024,
            "hidden_size": hidden,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "rope_parameters": _MROPE,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,  # read by the code, not declared by the config
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "initializer_range": 0.2,
        },
        "code_predictor_config": {
            "vocab_size": CODEBOOK_SIZE,
            "hidden_size": hidden,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "num_code_groups": NUM_CODE_GROUPS,
            "initializer_range": 0.2,
        },
        "num_code_groups": NUM_CODE_GROUPS,
        "thinker_hidden_size": hidden,
        "accept_hidden_layer": 1,
        **CODEC_IDS,
        "audio_token_id": t["<|audio_pad|>"],
        "image_token_id": t["<|image_pad|>"],
        "video_token_id": t["<|video_pad|>"],
        "vision_start_token_id": t["<|vision_start|>"],
        "audio_start_token_id": t["<|audio_start|>"],
        "spatial_merge_size": 2,  # read by the code, not declared by the config
        "speaker_id": dict(SPEAKERS),
        "initializer_range": 0.2,
    }
    code2wav = {
        "codebook_size": CODEBOOK_SIZE,
        "hidden_size": hidden,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_quantizers": NUM_CODE_GROUPS,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 32,
        "sliding_window": 72,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        # Weights wide enough that the random vocoder makes audible noise (std ~0.03) instead
        # of ~1e-7, yet does not saturate at the +-1 clamp (0.2 does).
        "initializer_range": 0.1,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        im_start_token_id=t["<|im_start|>"],
        im_end_token_id=t["<|im_end|>"],
        tts_pad_token_id=t["<|tts_pad|>"],
        tts_bos_token_id=t["<|tts_bos|>"],
        tts_eos_token_id=t["<|tts_eos|>"],
        system_token_id=t["system"],
        user_token_id=t["user"],
        assistant_token_id=t["assistant"],
    )


def build_tiny_omni(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny checkpoint and tokenizer to ``path`` (which must not hold another model)."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    # Seed a private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = Qwen3OmniMoeForConditionalGeneration(config)
        _init_talker_experts(model)
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all() or param.abs().max() > 100:
            raise RuntimeError(f"tiny checkpoint: parameter {name} was left uninitialized")
    model.eval()
    model.save_pretrained(out)
    build_byte_tokenizer().save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"name": TINY_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def _init_talker_experts(model) -> None:
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerTextExperts

    # transformers 5.14's _init_weights skips the talker's fused expert weights: they would
    # keep whatever torch.empty left in memory (nondeterministic, often 1e30-sized).
    std = model.config.talker_config.text_config.initializer_range
    with torch.no_grad():
        for module in model.talker.modules():
            if isinstance(module, Qwen3OmniMoeTalkerTextExperts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)


def ensure_tiny_omni(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny checkpoint, building it on first use. (see :mod:`omni_serve.checkpoints`)."""
    return ensure_checkpoint(TINY_NAME, build_tiny_omni, _MARKER, BUILD_VERSION, cache_dir)


def resolve_model(model: str) -> str:
    """``"tiny"`` -> the cached tiny checkpoint's path; any other model name unchanged."""
    return str(ensure_tiny_omni()) if model == "tiny" else model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (or find) the tiny random-weight Qwen3-Omni checkpoint.")
    parser.add_argument(
        "--cache-dir", default=None, help="Cache root (default: $OMNI_SERVE_CACHE, else ~/.cache/omni_serve)."
    )
    args = parser.parse_args(argv)
    print(ensure_tiny_omni(args.cache_dir))


if __name__ == "__main__":
    main()
