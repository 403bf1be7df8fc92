"""The tiny random-weight Qwen2.5-Omni checkpoint (vLLM-Omni pipeline ``qwen2_5_omni``): thinker, talker, token2wav.

The architecture is transformers' ``Qwen2_5OmniForConditionalGeneration`` at toy sizes, saved with
``save_pretrained`` in the released ``Qwen/Qwen2.5-Omni-7B`` layout, which vLLM-Omni reads unmodified:
``config.json`` (``thinker_config``, ``talker_config``, ``token2wav_config``), the weights under
``thinker.*`` (Qwen2 LLM, Whisper-style audio tower, Qwen2.5-VL vision tower), ``talker.*`` (a Qwen2
codec LM fed the thinker's states) and ``token2wav.*`` (a DiT that turns codec ids into mel frames with
an ECAPA speaker encoder, and a BigVGAN vocoder), ``spk_dict.pt`` (the voices), the tokenizer, chat
template and processor files (``Qwen2_5OmniProcessor``: Whisper features, Qwen2-VL image and video).

Real facts kept, because vLLM-Omni or transformers hard-code them: the thinker vocabulary of 152064
with Qwen2.5-Omni's special tokens at their ids (``<|AUDIO|>`` 151646, ``<|IMAGE|>`` 151655, ...), the
talker's text ids (tts pad/bos/eos 151859-151861, the voices' bos tokens 151870 Ethan and 151872
Chelsie), the codec vocabulary of 8448 with its specials (pad 8292, bos 8293, eos 8294, mask 8296)
and the DiT's 8193 codec embeddings (the talker suppresses ids above them), 128 mel bins in, 80 mel
bins out, two mel frames per codec id and a hop of 240 samples at 24 kHz (upsampling 5*3*2*2*2*2).
The weights are stored in bfloat16, as the released checkpoint's.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import TYPE_CHECKING, Any

from omni_serve.checkpoints.cache import ensure_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TINY_NAME = "tiny-qwen2.5-omni"
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 1
_MARKER = "omni_serve_tiny.json"
_SEED = 2525

# --- the tokenizer: bytes, filler words and Qwen2.5-Omni's real role and special ids -------------
ROLE_IDS = {"user": 872, "system": 8948, "assistant": 77091}
SPECIAL_TOKENS = (  # from id 151643 on, in id order; (name, special)
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|AUDIO|>", True),
    ("<|audio_bos|>", True),
    ("<|audio_eos|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_bos|>", True),
    ("<|vision_eos|>", True),
    ("<|vision_pad|>", True),
    ("<|IMAGE|>", True),
    ("<|VIDEO|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
FIRST_SPECIAL_ID = 151643
TOKEN_IDS: dict[str, int] = {**ROLE_IDS, **{name: FIRST_SPECIAL_ID + i for i, (name, _) in enumerate(SPECIAL_TOKENS)}}
TOKENIZER_SIZE = FIRST_SPECIAL_ID + len(SPECIAL_TOKENS)  # 151665; the embedding has padding rows above
THINKER_VOCAB = 152064
# What Qwen2_5OmniProcessor reads off the tokenizer by name (the real tokenizer config's names).
MULTIMODAL_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
# Thinker ids past the tokenizer that the talker embeds: its text specials and each voice's bos token
# (vLLM-Omni hard-codes the voices' ids: qwen2_5_omni.py, _init_special_tokens_embeddings).
TTS_TEXT_IDS = {"tts_text_pad_token_id": 151859, "tts_text_start_token_id": 151860, "tts_text_end_token_id": 151861}
VOICE_BOS_IDS = {"Ethan": 151870, "Chelsie": 151872}

# --- the codec: the real ids (vLLM-Omni hard-codes bos 8293 and eos 8294, the talker's stop token) ---
TALKER_VOCAB = 8448
CODEC_IDS = {
    "tts_codec_pad_token_id": 8292,
    "tts_codec_start_token_id": 8293,
    "tts_codec_end_token_id": 8294,
    "tts_codec_mask_token_id": 8296,
}
DIT_CODEC_EMBEDS = 8193  # codec ids the DiT embeds; the talker never samples above them but eos
MEL_DIM = 80
SAMPLE_RATE = 24000
HOP = 240  # samples per mel frame: the BigVGAN's upsampling, 5*3*2*2*2*2
UPSAMPLE_RATES = [5, 3, 2, 2, 2, 2]
NUM_MEL_BINS = 128  # the audio tower's Whisper features, as the real model's

# head_dim 32: the smallest vLLM's CPU attention accepts; vLLM's Qwen2 derives it as hidden / heads, so one
# head of 32. The 3D RoPE's sections must sum to head_dim / 2 (the real [16, 24, 24] of 128, a quarter).
HIDDEN = 32
HEAD_DIM = 32
_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}
_INIT_STD = 0.2  # wide enough that random layers do not collapse every state to the same token
# token2wav's weights (read by transformers' init, not declared by its configs): at the default 0.02 the random
# DiT and vocoder make ~1e-8 of audio; 0.1 makes audible noise (std ~0.2, 0.1 % of samples at the +-1 clamp);
# 0.2 saturates it.
_VOCODER_STD = 0.1


def _text_config() -> dict[str, Any]:
    return {
        "vocab_size": THINKER_VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": HIDDEN // HEAD_DIM,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "rope_parameters": dict(_MROPE),
        "tie_word_embeddings": False,  # as the 7B's: its own lm_head (the silenced rows below need it)
        "initializer_range": _INIT_STD,
    }


def _thinker_config() -> dict[str, Any]:
    from omni_serve.checkpoints.tiny_omni import VISION_MERGE, VISION_PATCH

    t = TOKEN_IDS
    return {
        "text_config": _text_config(),
        "audio_config": {
            "num_mel_bins": NUM_MEL_BINS,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "d_model": 16,
            "output_dim": HIDDEN,
            "max_source_positions": 1500,
            "n_window": 100,
            "initializer_range": _INIT_STD,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "patch_size": VISION_PATCH,
            "spatial_merge_size": VISION_MERGE,
            "temporal_patch_size": 2,
            # Windows of 4x4 merged patches, as the real 112 px of 14 px patches merged 2x2.
            "window_size": 4 * VISION_PATCH * VISION_MERGE,
            "fullatt_block_indexes": [1],
            "out_hidden_size": HIDDEN,
            "tokens_per_second": 25,  # read by vLLM and the processor, not declared by the config
            "initializer_range": _INIT_STD,
        },
        "audio_token_index": t["<|AUDIO|>"],
        "image_token_index": t["<|IMAGE|>"],
        "video_token_index": t["<|VIDEO|>"],
        "audio_start_token_id": t["<|audio_bos|>"],
        "audio_end_token_id": t["<|audio_eos|>"],
        # Read by vLLM-Omni's MRoPE positions, not declared by the config (the real config.json has them).
        "vision_start_token_id": t["<|vision_bos|>"],
        "vision_end_token_id": t["<|vision_eos|>"],
        "vision_token_id": t["<|vision_pad|>"],
        "user_token_id": t["user"],
        "pad_token_id": t["<|endoftext|>"],
        "bos_token_id": t["<|endoftext|>"],
        "eos_token_id": t["<|im_end|>"],
        "initializer_range": _INIT_STD,
    }


def _talker_config() -> dict[str, Any]:
    t = TOKEN_IDS
    return {
        "vocab_size": TALKER_VOCAB,
        "embedding_size": HIDDEN,  # the thinker's width, projected to the talker's
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": HIDDEN // HEAD_DIM,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "rope_parameters": dict(_MROPE),
        **CODEC_IDS,
        **TTS_TEXT_IDS,
        "audio_token_index": t["<|AUDIO|>"],
        "image_token_index": t["<|IMAGE|>"],
        "video_token_index": t["<|VIDEO|>"],
        "vision_start_token_id": t["<|vision_bos|>"],
        "vision_end_token_id": t["<|vision_eos|>"],
        "audio_start_token_id": t["<|audio_bos|>"],
        "audio_end_token_id": t["<|audio_eos|>"],
        "initializer_range": _INIT_STD,
    }


def _token2wav_config() -> dict[str, Any]:
    # The ECAPA speaker encoder concatenates its three middle blocks' outputs: the last channel count is
    # three times theirs (the real 768 = 3 * 256). Its Res2Net blocks split channels by enc_res2net_scale.
    enc = 32
    dit = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 16,
        "ff_mult": 2,
        "emb_dim": 16,
        "block_size": 24,
        "look_ahead_layers": [1],
        "look_backward_layers": [0],
        "repeats": 2,
        "num_embeds": DIT_CODEC_EMBEDS,
        "mel_dim": MEL_DIM,
        "enc_emb_dim": 16,
        "enc_dim": 16,
        "enc_channels": [enc, enc, enc, enc, 3 * enc],
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_attention_channels": 8,
        "enc_res2net_scale": 2,
        "enc_se_channels": 8,
        "initializer_range": _VOCODER_STD,
    }
    # Six upsampling layers halve the channels each: 64 leaves the last one 1 channel.
    bigvgan = {
        "mel_dim": MEL_DIM,
        "upsample_initial_channel": 64,
        "resblock_kernel_sizes": [3, 7, 11],
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "upsample_rates": UPSAMPLE_RATES,
        "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
        "initializer_range": _VOCODER_STD,
    }
    return {"dit_config": dit, "bigvgan_config": bigvgan}


def tiny_config():
    """The ``Qwen2_5OmniConfig`` of the tiny checkpoint."""
    from transformers import Qwen2_5OmniConfig

    config = Qwen2_5OmniConfig(
        thinker_config=_thinker_config(),
        talker_config=_talker_config(),
        token2wav_config=_token2wav_config(),
        enable_audio_output=True,
    )
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    return config


# ChatML with Qwen2.5-Omni's media placeholders: tiny_omni's template (tools included) with them swapped in
# (a change to that template changes this checkpoint's: bump BUILD_VERSION with it).
_PLACEHOLDERS = {
    "<|vision_start|><|image_pad|><|vision_end|>": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "<|audio_start|><|audio_pad|><|audio_end|>": "<|audio_bos|><|AUDIO|><|audio_eos|>",
    "<|vision_start|><|video_pad|><|vision_end|>": "<|vision_bos|><|VIDEO|><|vision_eos|>",
}


def chat_template() -> str:
    from omni_serve.checkpoints.tiny_omni import CHAT_TEMPLATE

    template = CHAT_TEMPLATE
    for qwen3, qwen2_5 in _PLACEHOLDERS.items():
        if qwen3 not in template:
            raise RuntimeError(f"tiny_omni's chat template lost its placeholder {qwen3!r}")
        template = template.replace(qwen3, qwen2_5)
    return template


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Bytes at 0..255, the role words and special tokens at their real ids, a filler word at every other id."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from omni_serve.checkpoints.tiny_omni import _byte_level_tokenizer, _check_ids, filler_word

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    named = {token_id: token for token, token_id in TOKEN_IDS.items()}
    for token_id in range(256, TOKENIZER_SIZE):
        vocab[named.get(token_id) or filler_word(token_id)] = token_id
    tok = _byte_level_tokenizer(vocab, [(word, False) for word in ROLE_IDS] + list(SPECIAL_TOKENS))
    _check_ids(tok, TOKEN_IDS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=dict(MULTIMODAL_TOKENS),
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template()
    return fast


def processor_files() -> dict[str, dict[str, Any]]:
    """The processor's JSON files, sized for the tiny encoders (tiny_omni's image/video sizes, 128 mel bins)."""
    from omni_serve.checkpoints import tiny_omni

    files = tiny_omni.processor_files()
    files["preprocessor_config.json"]["feature_size"] = NUM_MEL_BINS
    for content in files.values():
        content["processor_class"] = "Qwen2_5OmniProcessor"
    return files


def _speakers(config: Any) -> dict[str, dict[str, Any]]:
    """``spk_dict.pt``: per voice its thinker bos token, a speaker embedding and a reference mel (random)."""
    import torch

    dit = config.token2wav_config.dit_config
    return {
        voice: {
            "bos_token": bos,
            "cond": torch.randn(1, dit.enc_emb_dim),
            "ref_mel": torch.randn(1, 300, dit.mel_dim) * 0.5,
        }
        for voice, bos in VOICE_BOS_IDS.items()
    }


def build_tiny_qwen2_5_omni(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny checkpoint, its voices, tokenizer and processor files to ``path``."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    # A private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = Qwen2_5OmniForConditionalGeneration(config)
        speakers = _speakers(config)
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all() or param.abs().max() > 100:
            raise RuntimeError(f"tiny checkpoint: parameter {name} was left uninitialized")
    _silence_unprintable_outputs(model)
    model.eval()
    model.to(torch.bfloat16).save_pretrained(out)
    torch.save(speakers, out / "spk_dict.pt")
    build_tokenizer().save_pretrained(out)
    for name, content in processor_files().items():
        (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    (out / _MARKER).write_text(json.dumps({"name": TINY_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def _silence_unprintable_outputs(model: Any) -> None:
    """Zero the thinker's output rows of non-printable bytes, special tokens and the ids past the tokenizer.

    A zero row has logit 0, far below the top logit of 150k random rows, so greedy text is printable
    (bytes and filler words) and never a media placeholder or an id the tokenizer cannot decode. The
    thinker then never ends on its own: generation stops at max_tokens or a stop string.
    """
    import torch

    rows = [b for b in range(256) if not 0x20 <= b < 0x7F] + list(range(FIRST_SPECIAL_ID, THINKER_VOCAB))
    with torch.no_grad():
        model.thinker.lm_head.weight[rows] = 0.0


def ensure_tiny_qwen2_5_omni(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny checkpoint, building it on first use (see :mod:`omni_serve.checkpoints.cache`)."""
    return ensure_checkpoint(TINY_NAME, build_tiny_qwen2_5_omni, _MARKER, BUILD_VERSION, cache_dir)
