"""The tiny random-weight Qwen3-Omni checkpoint, its tokenizer and processor files.

The checkpoint has the real transformers architecture (thinker with audio and vision
towers, talker with its code predictor, code2wav) at toy sizes, so every serving code
path runs on a CPU without a model hub, on both engine families: transformers loads it,
and so does vLLM-Omni, unmodified. It is built deterministically (fixed seed) on first
use and cached; several replicas may ask for it at once.

Real Qwen3-Omni facts kept: the vocabulary's special-token ids and names (vLLM-Omni
hard-codes some), 16 code groups per codec frame, 1920 samples per frame at 24 kHz
(upsampling 8*5*4*3 * 2*2), a talker vocab of codebook + 1024 whose top 1024 ids hold the
codec specials, the ChatML prompt format with media placeholders, a complete
``Qwen3OmniMoeProcessor`` (Whisper features, Qwen2-VL image and video processors) sized
for the tiny encoders. The small byte tokenizer of the other tiny models lives here too.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import TYPE_CHECKING, Any

from omni_serve.checkpoints import resolve
from omni_serve.checkpoints.cache import ensure_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TINY_NAME = "tiny-qwen3-omni"
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 6  # 6: the chat template takes tools (Qwen's tool-call protocol)
_MARKER = "omni_serve_tiny.json"
_SEED = 1234

# --- the small byte tokenizer (tiny Qwen3 text model, tiny Qwen-Image text encoder) ---------
# Token layout: ids 0..255 are the raw bytes, then the role words (single tokens like in the
# real Qwen vocab, so the talker can tell a segment's role from the token after <|im_start|>),
# then the special tokens. A model with this vocab can only sample ids that decode.
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

# --- the tiny Qwen3-Omni's tokenizer: Qwen3-Omni's real ids ----------------------------------
# vLLM-Omni hard-codes Qwen3-Omni's vocabulary in places (the talker prompt length reads
# <|im_start|>/system/user/assistant by id, the thinker the tts and audio ids), so the tiny
# checkpoint uses the real ids: bytes at 0..255, the role words at their real ids, the
# special tokens 151643..151675 with their real names. Every other id below 151643 is a
# filler word (a space and letters), so any sampled id decodes to text.
OMNI_ROLE_IDS = {"user": 872, "system": 8948, "assistant": 77091}
OMNI_SPECIAL_TOKENS = (  # from id 151643 on, in id order; (name, special)
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)
FIRST_SPECIAL_ID = 151643
OMNI_TOKEN_IDS: dict[str, int] = {
    **OMNI_ROLE_IDS,
    **{name: FIRST_SPECIAL_ID + i for i, (name, _) in enumerate(OMNI_SPECIAL_TOKENS)},
}
OMNI_VOCAB_SIZE = FIRST_SPECIAL_ID + len(OMNI_SPECIAL_TOKENS)  # 151676
# What Qwen3OmniMoeProcessor reads off the tokenizer by name (the real tokenizer config's names).
MULTIMODAL_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# ChatML; list contents (OpenAI-style parts) get Qwen3-Omni's media placeholders, which
# Qwen3OmniMoeProcessor expands to one pad token per encoder feature. Tools follow Qwen's protocol
# (what Qwen3-Omni's own template writes, in our words): the functions in a first system turn between
# <tools></tools>, an assistant turn's calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>
# (what vLLM's `hermes` tool parser reads back), each tool result as a <tool_response> in a user turn.
# Without tools the prompt is plain ChatML, byte for byte what it was before tools.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is not none -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- render(messages[0]['content']) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- " + repr(TOOLS_PREAMBLE) + " -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- " + repr(TOOLS_POSTAMBLE) + " + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and tools and loop.first -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render(message['content']) -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set arguments = call['function']['arguments'] -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
    "{{- (arguments if arguments is string else arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
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
SAMPLES_PER_FRAME = 1920

# Encoders, kept consistent with the processor files: vision patches of 4 px merged 2x2
# (one image token per 8x8 px), a 4x4 grid of learned position embeddings (image_size 16,
# interpolated for other sizes, as in the real model), 16 mel bins for audio.
VISION_PATCH = 4
VISION_MERGE = 2
VISION_IMAGE_SIZE = 16
NUM_MEL_BINS = 16


def _byte_level_tokenizer(vocab: dict[str, int], added: list[tuple[str, bool]]) -> Any:
    """A byte-level BPE without merges: every byte is a token; ``added`` (name, special) keep their vocab ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, special in added if not special])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, special in added if special])
    return tok


def _check_ids(tok: Any, ids: dict[str, int]) -> None:
    for token, token_id in ids.items():
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"tokenizer layout drifted: {token!r} has id {tok.token_to_id(token)}")


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte tokens, the ChatML role words and Qwen's special tokens.

    Any UTF-8 text round-trips. Reusable by other tiny models (ids are fixed, see ``TOKEN_IDS``).
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    # Added in id order after the bytes, so ids follow TOKEN_IDS.
    added = [(w, False) for w in ROLE_WORDS] + [(t, True) for t in SPECIAL_TOKENS]
    tok = _byte_level_tokenizer({byte_chars[b]: b for b in range(256)}, added)
    _check_ids(tok, TOKEN_IDS)

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


def filler_word(token_id: int) -> str:
    """The filler token of ``token_id``: a space and 2-4 letters (byte-level spelling: 'Ġ' is the space)."""
    letters = ""
    n = token_id
    while True:
        n, r = divmod(n, 26)
        letters += chr(ord("a") + r)
        if n == 0:
            break
    return "\u0120" + letters


def build_omni_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny Qwen3-Omni tokenizer: bytes, filler words and Qwen3-Omni's real role/special ids (see above)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    named = {token_id: token for token, token_id in OMNI_TOKEN_IDS.items()}
    for token_id in range(256, OMNI_VOCAB_SIZE):
        vocab[named.get(token_id) or filler_word(token_id)] = token_id
    added = [(word, False) for word in OMNI_ROLE_IDS] + list(OMNI_SPECIAL_TOKENS)
    tok = _byte_level_tokenizer(vocab, added)
    _check_ids(tok, OMNI_TOKEN_IDS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=dict(MULTIMODAL_TOKENS),
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# 3D RoPE of the thinker and talker; sum(mrope_section) must be head_dim / 2. head_dim 32:
# the smallest vLLM's CPU attention accepts (CPUAttentionBackend.get_supported_head_sizes).
HEAD_DIM = 32
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4], "interleaved": True}
# The thinker's positions are interleaved T/H/W: transformers always interleaves them, vLLM only when
# the config says `mrope_interleaved` (as the real Qwen3-Omni thinker config does; its talker's does not).
# Without it vLLM places image and video tokens (whose T/H/W positions differ) elsewhere than HF.
_THINKER_MROPE = {**_MROPE, "mrope_interleaved": True}


def tiny_config():
    """The ``Qwen3OmniMoeConfig`` of the tiny checkpoint."""
    from transformers import Qwen3OmniMoeConfig

    t = OMNI_TOKEN_IDS
    hidden = 32
    text = {
        "vocab_size": OMNI_VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 1024,
        "rope_parameters": _THINKER_MROPE,
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
            "num_mel_bins": NUM_MEL_BINS,
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
            "patch_size": VISION_PATCH,
            "spatial_merge_size": VISION_MERGE,
            "temporal_patch_size": 2,
            "out_hidden_size": hidden,
            # Read by vLLM, not declared by the transformers config: (image_size / patch_size)^2
            # learned position embeddings, as num_position_embeddings says for transformers.
            "image_size": VISION_IMAGE_SIZE,
            "num_position_embeddings": (VISION_IMAGE_SIZE // VISION_PATCH) ** 2,
            "apply_vit_abs_pos_embed": True,
            "deepstack_visual_indexes": [0],
        },
        "audio_token_id": t["<|audio_pad|>"],
        "image_token_id": t["<|image_pad|>"],
        "video_token_id": t["<|video_pad|>"],
        "audio_start_token_id": t["<|audio_start|>"],
        "audio_end_token_id": t["<|audio_end|>"],
        "vision_start_token_id": t["<|vision_start|>"],  # read by the code, not declared by the config
        "vision_end_token_id": t["<|vision_end|>"],
        "user_token_id": t["user"],
        # As in the real config (the default is 25): the processor interleaves a video's audio and
        # frames at 13 positions a second, and vLLM and the model's RoPE read this value.
        "position_id_per_seconds": 13,
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
            "head_dim": HEAD_DIM,
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
            "head_dim": HEAD_DIM,
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
        "spatial_merge_size": VISION_MERGE,  # read by the code, not declared by the config
        "speaker_id": dict(SPEAKERS),
        "position_id_per_seconds": 13,  # as the thinker's
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
        tts_pad_token_id=t["<tts_pad>"],
        tts_bos_token_id=t["<tts_text_bos>"],
        tts_eos_token_id=t["<tts_text_eod>"],
        system_token_id=t["system"],
        user_token_id=t["user"],
        assistant_token_id=t["assistant"],
    )


def vision_processor_config() -> dict[str, Any]:
    """Qwen2-VL image/video processor settings for the tiny vision encoders (``VISION_*``): 4 px patches merged
    2x2, 1..64 image tokens (8x8 .. 64x64 px after Qwen2-VL's smart resize)."""
    return {
        "patch_size": VISION_PATCH,
        "merge_size": VISION_MERGE,
        "temporal_patch_size": 2,
        "min_pixels": (VISION_PATCH * VISION_MERGE) ** 2,
        "max_pixels": 64 * 64,
        "size": {"shortest_edge": (VISION_PATCH * VISION_MERGE) ** 2, "longest_edge": 64 * 64},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "rescale_factor": 1 / 255,
    }


def processor_files() -> dict[str, dict[str, Any]]:
    """The processor's JSON files (``Qwen3OmniMoeProcessor``: Whisper features, Qwen2-VL image and video).

    Written as data rather than through the processor classes: the video processor class needs
    torchvision, which the transformers-only install does not have, and the build must not
    depend on what is installed. Sizes match the tiny encoders (see ``VISION_*``, ``NUM_MEL_BINS``).
    """
    vision = vision_processor_config()
    feature_extractor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": NUM_MEL_BINS,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "dither": 0.0,
    }
    return {
        "preprocessor_config.json": {
            **feature_extractor,
            **vision,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3OmniMoeProcessor",
        },
        "video_preprocessor_config.json": {
            **vision,
            "video_processor_type": "Qwen2VLVideoProcessor",
            "min_frames": 2,
            "max_frames": 16,
            "fps": 2.0,
            "do_sample_frames": False,
            "processor_class": "Qwen3OmniMoeProcessor",
        },
    }


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
    _silence_unprintable_outputs(model)
    model.eval()
    model.save_pretrained(out)
    build_omni_tokenizer().save_pretrained(out)
    for name, content in processor_files().items():
        (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    (out / _MARKER).write_text(json.dumps({"name": TINY_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def _silence_unprintable_outputs(model: Any) -> None:
    """Zero the thinker's output rows of special tokens and non-printable bytes.

    With random weights the thinker would otherwise now and then sample a media placeholder
    or half a UTF-8 sequence; a zero row has logit 0 while the top logit of 150k random rows
    is far above it, so greedy text is printable ASCII (bytes and filler words) and sampled
    text almost surely is. The model then never ends on its own: generation stops at
    max_tokens, a stop string or a stop token id.
    """
    import torch

    rows = [b for b in range(256) if not 0x20 <= b < 0x7F] + list(range(FIRST_SPECIAL_ID, OMNI_VOCAB_SIZE))
    with torch.no_grad():
        model.thinker.lm_head.weight[rows] = 0.0


def _init_talker_experts(model: Any) -> None:
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
    """Path of the cached tiny checkpoint, building it on first use. (see :mod:`omni_serve.checkpoints.cache`)."""
    return ensure_checkpoint(TINY_NAME, build_tiny_omni, _MARKER, BUILD_VERSION, cache_dir)


def resolve_model(model: str) -> str:
    """``"tiny"`` -> this checkpoint's cached path (other registered names theirs); anything else unchanged."""
    return resolve(model, tiny=TINY_NAME)
