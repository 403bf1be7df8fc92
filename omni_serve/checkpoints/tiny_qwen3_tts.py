"""The tiny random-weight Qwen3-TTS checkpoint (vLLM-Omni pipeline ``qwen3_tts``), with its tokenizer files.

Qwen3-TTS is a talker (a Qwen3 decoder over codec frames, plus a code predictor for the residual
code groups, a text embedding with its projection, an ECAPA-TDNN speaker encoder) and a speech
tokenizer (``speech_tokenizer/``: a Mimi encoder that turns reference audio into codes, and the
12.5 Hz decoder, "code2wav", that turns codes into 24 kHz audio). vLLM-Omni 0.30 ships the whole
architecture (``vllm_omni.model_executor.models.qwen3_tts``); transformers does not. So the
configs are vLLM-Omni's own classes (``Qwen3TTSConfig``, ``Qwen3TTSTokenizerV2Config``, with
transformers' ``MimiConfig`` inside), the speech tokenizer and the speaker encoder are vLLM-Omni's
own modules, and the talker's two decoder stacks are transformers' ``Qwen3Model`` at the talker's
sizes, saved under the names of the official checkpoint (``talker.model.*``,
``talker.code_predictor.*``, ``talker.codec_head``, ``talker.text_projection``), which is what
vLLM-Omni's loader maps (its loader is strict: a missing tensor fails the load).

Real Qwen3-TTS facts kept, because vLLM-Omni hard-codes or derives them:

- the codec vocabulary: codebook 2048, talker vocab 3072 with the codec specials at their real
  ids (codec EOS 2150 is the pipeline's stop token id, ``pipeline.py``), 16 code groups a frame;
- the speech tokenizer's rates: 24 kHz in and out, 1920 samples a frame (12.5 frames a second);
- the text side: the real Qwen ids and ChatML (the tokenizer of the tiny Qwen3-Omni, whose
  ``<|im_start|>assistant\\n`` is three tokens, as the prompt builder slices it), text vocab 151936;
- the speaker encoder's 128 mel bins and 24 kHz, its output size the talker's hidden size (an
  x-vector is concatenated with codec embeddings).

One checkpoint has all three voice modes: it names speakers (``spk_id``: CustomVoice) and carries
the speaker encoder (Base: reference-audio clone), and leaves ``tts_model_type`` unset, so
vLLM-Omni's speech adapter takes every ``task_type`` (CustomVoice, VoiceDesign, Base). The real
checkpoints are one per task type with the same architecture; a tiny one for each would cost CI a
server start per mode for nothing the architecture differs in.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from omni_serve.checkpoints.cache import ensure_checkpoint

TINY_NAME = "tiny-qwen3-tts"
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 4  # 4: the tokenizer of tiny_omni 6 (a chat template that takes tools)
_MARKER = "omni_serve_tiny.json"
_SEED = 4321

SPEECH_TOKENIZER = "speech_tokenizer"  # the subfolder vLLM-Omni reads the codec from
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920  # 8*5*4*3 * 2*2 (decoder), the Mimi encoder's hop 8*6*5*4 * 2
NUM_CODE_GROUPS = 16
CODEBOOK_SIZE = 2048
TALKER_VOCAB = 3072
TEXT_VOCAB = 151936
# The real checkpoint's codec specials (talker vocab ids above the codebook).
CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
LANGUAGES = {"english": 2050, "chinese": 2055}
SPEAKERS = {"vivian": 3065, "ryan": 3061}
TALKER_HIDDEN = 64
# The codec EOS row of the talker's head, this many times as wide as the others: its logit then swings above
# every code's now and then, so replies end on their own (a few seconds of audio) as a real talker's do. With
# rows alike a random talker almost never samples EOS, and vLLM-Omni refuses a clone (Base) reply that
# reaches its token budget without EOS (``Qwen3TTSCodecLimitError``).
EOS_ROW_SCALE = 2.5
TEXT_HIDDEN = 32
HEAD_DIM = 32  # the smallest head size vLLM's CPU attention takes


def tiny_config() -> Any:
    """The ``Qwen3TTSConfig`` (vLLM-Omni's class) of the tiny checkpoint."""
    from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import Qwen3TTSConfig

    from omni_serve.checkpoints.tiny_omni import OMNI_TOKEN_IDS

    t = OMNI_TOKEN_IDS
    talker = {
        "vocab_size": TALKER_VOCAB,
        "hidden_size": TALKER_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,  # read by vLLM's Qwen3 layers; the config class does not declare it
        "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "default", "mrope_section": [8, 4, 4], "interleaved": True},
        "num_code_groups": NUM_CODE_GROUPS,
        "text_hidden_size": TEXT_HIDDEN,
        "text_vocab_size": TEXT_VOCAB,  # read by the talker, not declared by the config class
        "position_id_per_seconds": SAMPLE_RATE / SAMPLES_PER_FRAME,  # the codec frame rate vLLM-Omni reads
        **CODEC_IDS,
        "spk_id": dict(SPEAKERS),
        "spk_is_dialect": {name: False for name in SPEAKERS},
        "codec_language_id": dict(LANGUAGES),
        "initializer_range": 0.2,
        "code_predictor_config": {
            "vocab_size": CODEBOOK_SIZE,
            "hidden_size": TALKER_HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": HEAD_DIM,
            "num_code_groups": NUM_CODE_GROUPS,
            "max_position_embeddings": 64,
            "initializer_range": 0.2,
        },
    }
    speaker_encoder = {
        "mel_dim": 128,
        "enc_dim": TALKER_HIDDEN,
        "enc_channels": [32, 32, 32, 32, 96],
        "enc_attention_channels": 16,
        "enc_res2net_scale": 4,
        "enc_se_channels": 16,
        "sample_rate": SAMPLE_RATE,
    }
    return Qwen3TTSConfig(
        talker_config=talker,
        speaker_encoder_config=speaker_encoder,
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size="tiny",
        tts_model_type=None,  # every task type (see the module doc)
        im_start_token_id=t["<|im_start|>"],
        im_end_token_id=t["<|im_end|>"],
        tts_pad_token_id=t["<tts_pad>"],
        tts_bos_token_id=t["<tts_text_bos>"],
        tts_eos_token_id=t["<tts_text_eod>"],
        architectures=["Qwen3TTSForConditionalGeneration"],
        # As the real checkpoints: vLLM-Omni's talker casts its per-request embeddings to bfloat16 whatever the
        # engine's dtype (``_embedding_dtype``, vllm-project/vllm-omni PR #6545 open), so a float32 talker dies on
        # its first request (index_copy_ dtype mismatch). ``auto`` must resolve to bfloat16.
        dtype="bfloat16",
    )


def speech_tokenizer_config() -> Any:
    """The ``Qwen3TTSTokenizerV2Config`` of ``speech_tokenizer/``: a Mimi encoder, the 12.5 Hz decoder."""
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )

    encoder = {
        "sampling_rate": SAMPLE_RATE,
        "frame_rate": SAMPLE_RATE / SAMPLES_PER_FRAME,
        "audio_channels": 1,
        "hidden_size": 32,
        "num_filters": 4,
        "num_residual_layers": 1,
        "upsampling_ratios": [8, 6, 5, 4],
        "kernel_size": 7,
        "last_kernel_size": 3,
        "residual_kernel_size": 3,
        "dilation_growth_rate": 2,
        "compress": 2,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "sliding_window": 250,
        "codebook_size": CODEBOOK_SIZE,
        "codebook_dim": 16,
        "num_quantizers": NUM_CODE_GROUPS,
        "num_semantic_quantizers": 1,
        "vector_quantization_hidden_dimension": 16,
        "use_conv_shortcut": False,
        "upsample_groups": 32,  # = hidden_size (depthwise, as the real 512 of 512)
        "initializer_range": 0.2,
    }
    decoder = {
        "codebook_size": CODEBOOK_SIZE,
        "codebook_dim": 16,  # read by the decoder, not declared by its config class
        "hidden_size": 32,
        "latent_dim": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_quantizers": NUM_CODE_GROUPS,
        "sliding_window": 72,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 32,
        "max_position_embeddings": 8000,
        "initializer_range": 0.1,
    }
    return Qwen3TTSTokenizerV2Config(
        encoder_config=encoder,
        decoder_config=decoder,
        encoder_valid_num_quantizers=NUM_CODE_GROUPS,
        input_sample_rate=SAMPLE_RATE,
        output_sample_rate=SAMPLE_RATE,
        decode_upsample_rate=SAMPLES_PER_FRAME,
        encode_downsample_rate=SAMPLES_PER_FRAME,
        architectures=["Qwen3TTSTokenizerV2Model"],
    )


def _qwen3_stack(cfg: dict[str, Any], vocab: int, hidden: int) -> Any:
    """transformers' Qwen3 decoder at these sizes: the talker's and the code predictor's layer names."""
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(
        Qwen3Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            initializer_range=cfg["initializer_range"],
        )
    )


def _talker_state(config: Any) -> dict[str, Any]:
    """The talker's and the speaker encoder's tensors under the official checkpoint's names."""
    import torch
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import Qwen3TTSSpeakerEncoder

    talker = config.talker_config
    tc, cp = talker.to_dict(), talker.code_predictor_config.to_dict()
    state: dict[str, torch.Tensor] = {}
    body = _qwen3_stack(tc, talker.vocab_size, talker.hidden_size)
    for name, tensor in body.state_dict().items():
        name = name.replace("embed_tokens.", "codec_embedding.")
        state[f"talker.model.{name}"] = tensor
    std = talker.initializer_range
    state["talker.model.text_embedding.weight"] = torch.randn(talker.text_vocab_size, talker.text_hidden_size) * std
    for prefix, width in (("linear_fc1", talker.text_hidden_size), ("linear_fc2", talker.hidden_size)):
        state[f"talker.text_projection.{prefix}.weight"] = torch.randn(width, talker.text_hidden_size) * std
        state[f"talker.text_projection.{prefix}.bias"] = torch.zeros(width)
    head = torch.randn(talker.vocab_size, talker.hidden_size) * std
    head[talker.codec_eos_token_id] *= EOS_ROW_SCALE
    state["talker.codec_head.weight"] = head

    predictor = _qwen3_stack(cp, cp["vocab_size"], cp["hidden_size"])
    for name, tensor in predictor.state_dict().items():
        if not name.startswith("embed_tokens."):
            state[f"talker.code_predictor.model.{name}"] = tensor
    for group in range(talker.num_code_groups - 1):
        # The residual groups' embeddings are in the talker's width (the predictor projects them when narrower).
        state[f"talker.code_predictor.model.codec_embedding.{group}.weight"] = (
            torch.randn(cp["vocab_size"], talker.hidden_size) * std
        )
        state[f"talker.code_predictor.lm_head.{group}.weight"] = torch.randn(cp["vocab_size"], cp["hidden_size"]) * std

    speaker = Qwen3TTSSpeakerEncoder(config.speaker_encoder_config)
    for name, tensor in speaker.state_dict().items():
        state[f"speaker_encoder.{name}"] = tensor
    return {name: tensor.detach().contiguous().clone() for name, tensor in state.items()}


def _speech_tokenizer(config: Any) -> Any:
    """vLLM-Omni's ``Qwen3TTSTokenizerV2Model`` with random codebooks (the modules start them at zero)."""
    import torch
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    model = Qwen3TTSTokenizerV2Model(config)
    with torch.no_grad():
        # A zero codebook would decode every code to the same sound and encode every sound to code 0:
        # the codes would not matter. Random codebooks make them matter, as in the real codec.
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("embedding_sum", "embed_sum")):
                tensor.normal_(0.0, 1.0)
            elif name.endswith("cluster_usage"):
                tensor.fill_(1.0)
    return model


def _write_config(config: Any, out: pathlib.Path) -> None:
    """``config.json``, as the real checkpoint has it.

    ``Qwen3TTSSpeakerEncoderConfig`` takes no ``model_type`` (nor any other key it does not declare),
    but ``save_pretrained`` writes one into the sub-config: vLLM-Omni could not read it back.
    """
    data = config.to_dict()
    data["speaker_encoder_config"].pop("model_type", None)
    (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def feature_extractor_config() -> dict[str, Any]:
    """``speech_tokenizer/preprocessor_config.json``: Mimi's own feature extractor (raw 24 kHz mono)."""
    return {
        "feature_extractor_type": "EncodecFeatureExtractor",
        "feature_size": 1,
        "sampling_rate": SAMPLE_RATE,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "chunk_length_s": None,
        "overlap": None,
    }


def build_tiny_qwen3_tts(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny checkpoint, its tokenizer and its speech tokenizer to ``path``."""
    import torch
    from safetensors.torch import save_file

    from omni_serve.checkpoints.tiny_omni import build_omni_tokenizer

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    codec_config = speech_tokenizer_config()
    # Seed a private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        state = _talker_state(config)
        codec = _speech_tokenizer(codec_config)
    codec.eval()
    for name, tensor in [*state.items(), *codec.state_dict().items()]:
        if tensor.is_floating_point() and (not torch.isfinite(tensor).all() or tensor.abs().max() > 100):
            raise RuntimeError(f"tiny Qwen3-TTS: tensor {name} was left uninitialized")
    _write_config(config, out)
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    build_omni_tokenizer().save_pretrained(out)
    codec_dir = out / SPEECH_TOKENIZER
    codec.save_pretrained(codec_dir)
    (codec_dir / "preprocessor_config.json").write_text(json.dumps(feature_extractor_config(), indent=2) + "\n")
    (out / _MARKER).write_text(json.dumps({"name": TINY_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def ensure_tiny_qwen3_tts(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny checkpoint, building it on first use (see :mod:`omni_serve.checkpoints.cache`)."""
    return ensure_checkpoint(TINY_NAME, build_tiny_qwen3_tts, _MARKER, BUILD_VERSION, cache_dir)
