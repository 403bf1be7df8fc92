"""The tiny random-weight Voxtral TTS checkpoint (vLLM-Omni pipeline ``voxtral_tts``), in Mistral's format.

Voxtral TTS is a Mistral decoder (the "audio generation" LM: text and voice tokens in, one hidden state
a codec frame out), a flow-matching acoustic transformer on top of it (each hidden state -> a frame of
37 codes: a greedy semantic code, then 36 acoustic codes by ``n_decoding_steps`` Euler steps with
classifier-free guidance) and an audio tokenizer (the codec: a semantic codebook + 36 finite-scalar
acoustic levels, a convolution/sliding-window transformer decoder to 24 kHz, and the matching encoder
that turns reference audio into codes). Frames fed back to the LM are embedded by the tokenizer's
per-codebook embedding table. vLLM-Omni 0.30 ships the whole architecture
(``vllm_omni.model_executor.models.voxtral_tts``); transformers does not.

The checkpoint is Mistral's format, as the real ``mistralai/Voxtral-4B-TTS-2603`` is, read by
vLLM-Omni's ``VoxtralTTSConfigParser`` (``config_format``/``load_format``/``tokenizer_mode: mistral``
in its deploy config):

- ``params.json``: the Mistral text model's fields plus ``multimodal.audio_model_args`` (codebooks, the
  acoustic transformer, ``audio_encoding_args``) and ``multimodal.audio_tokenizer_args`` (the codec,
  and ``voice``: the preset voices). The configs of this module are read back through the parser, so
  the modules are built from vLLM-Omni's own config objects;
- ``consolidated.safetensors``: Mistral's names (``layers.N.attention.wq``, ...) for the LM, the LM's
  token embedding as ``mm_audio_embeddings.tok_embeddings``, the codebook embeddings as
  ``mm_audio_embeddings.audio_codebook_embeddings.embeddings``, ``acoustic_transformer.*`` and
  ``audio_tokenizer.*`` under the names of vLLM-Omni's own modules (its loaders look each name up
  and fail on an unknown one);
- ``tekken.json``: mistral_common's Tekken tokenizer (version v7, as the real one) with an ``audio``
  section (mistral_common's ``AudioConfig``: rates, and ``voice_num_audio_tokens``: how many
  ``[AUDIO]`` placeholders each preset voice's embedding fills);
- ``voice_embedding/<voice>.pt``: each preset voice, ``[voice_num_audio_tokens, dim]`` embeddings
  that replace the voice's ``[AUDIO]`` placeholders in the prompt.

Real Voxtral TTS facts kept, because vLLM-Omni or mistral_common hard-code or derive them:

- the special token ids: ``<s>`` 1, ``</s>`` 2, ``[AUDIO]`` 24, ``[BEGIN_AUDIO]`` 25,
  ``[REPEAT_AUDIO_TEXT]`` 35, ``[NEXT_AUDIO_TEXT]`` 36 (vLLM-Omni's dummy prompt hard-codes them) and
  1000 special tokens before the text vocabulary;
- the codec: 24 kHz, a 240-sample patch and encoder strides 2,2,2,1, so 1920 samples a frame
  (12.5 Hz); the semantic codebook of 8192 and 36 acoustic codebooks of 21 levels (37 codes a frame;
  code ids are offset by the two audio specials, ``[EMPTY_AUDIO]`` 0 and ``[END_AUDIO]`` 1, which
  vLLM-Omni's decoder cuts on);
- the text vocabulary is larger than the ids of vLLM-Omni's hard-coded dummy prompt (5117).

What is tiny: the LM (2 layers of width 64, head 32: the smallest head vLLM's CPU attention takes), the
acoustic transformer (2 layers), the codec (width 32, one transformer layer per stage), the semantic
codebook's width (16), and the text vocabulary (8192: 256 bytes and printable-ASCII pairs, no learnt
merges). Unlike the released checkpoint (decoder only), the codec's encoder is included, so
vLLM-Omni accepts ``ref_audio`` (voice cloning) as well as preset voices.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import pathlib
from typing import Any

from omni_serve.checkpoints.cache import ensure_checkpoint

TINY_NAME = "tiny-voxtral-tts"
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 3
_MARKER = "omni_serve_tiny.json"
_SEED = 2603

SAMPLE_RATE = 24000
PATCH = 240
SAMPLES_PER_FRAME = 1920  # PATCH x the encoder's strides 2*2*2*1
FRAME_RATE = SAMPLE_RATE / SAMPLES_PER_FRAME
SEMANTIC_CODEBOOK = 8192
ACOUSTIC_LEVELS = 21
ACOUSTIC_CODEBOOKS = 36
AUDIO_SPECIALS = 2  # [EMPTY_AUDIO] 0, [END_AUDIO] 1: code ids start after them
END_AUDIO = 1

NUM_SPECIAL_TOKENS = 1000
TEXT_VOCAB = 8192
# Special tokens at the ranks of the real tokenizer (vLLM-Omni's dummy prompt hard-codes 1, 24, 25, 35, 36);
# mistral_common's v7 instruct tokenizer looks the others up by name, so they are placed in free ranks.
SPECIAL_RANKS = {
    "<unk>": 0,
    "<s>": 1,
    "</s>": 2,
    "[INST]": 3,
    "[/INST]": 4,
    "[AVAILABLE_TOOLS]": 5,
    "[/AVAILABLE_TOOLS]": 6,
    "[TOOL_RESULTS]": 7,
    "[/TOOL_RESULTS]": 8,
    "[TOOL_CALLS]": 9,
    "[IMG]": 10,
    "<pad>": 11,
    "[IMG_BREAK]": 12,
    "[IMG_END]": 13,
    "[PREFIX]": 14,
    "[MIDDLE]": 15,
    "[SUFFIX]": 16,
    "[SYSTEM_PROMPT]": 17,
    "[/SYSTEM_PROMPT]": 18,
    "[TOOL_CONTENT]": 19,
    "[AUDIO]": 24,
    "[BEGIN_AUDIO]": 25,
    "[ARGS]": 32,
    "[CALL_ID]": 33,
    "[TRANSCRIBE]": 34,
    "[REPEAT_AUDIO_TEXT]": 35,
    "[NEXT_AUDIO_TEXT]": 36,
}
# A GPT-2-style split: letters with an optional leading non-letter, digits one by one, punctuation, spaces.
PATTERN = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

LM_DIM = 64
# Preset voices: the id in ``params.json`` and how many [AUDIO] frames the voice's embedding has.
VOICES = {"neutral_female": (0, 12), "casual_male": (1, 16)}
# The [END_AUDIO] row of the semantic head, this many times as wide as the others: its logit then wins the
# (greedy) semantic argmax now and then, so replies end on their own after a few seconds, as a real model's
# do. With rows alike a random head would practically never end a reply before its token budget.
END_AUDIO_ROW_SCALE = 3.0
# The acoustic codes of a frame come from flow matching: Euler steps from Gaussian noise that vLLM-Omni 0.30 draws
# from the worker's global RNG, which a request's seed does not reach (vllm-project/vllm-omni#6309, fix PR #6371
# open), so the real model's replies differ request to request. Here the noise cannot matter: the acoustic
# transformer's input projection (its only view of the noisy sample) is zero, and its head is this many times as
# wide, so the integrated velocity (a function of the LM's hidden state and the time step alone) always
# saturates the [-1, 1] clamp, and in bfloat16 swallows the noise it is added to. Each acoustic code is then
# level 0 or 20 by the sign of that velocity: replies are reproducible, so omni_serve's graph can be compared
# with native vLLM-Omni byte for byte.
ACOUSTIC_HEAD_SCALE = 1e6
# The codec encoder's last convolution (to the semantic + acoustic latent) gains this factor: at the modules' own
# initialisation its output is ~0.01 wide against codebook entries ~1 wide, so every reference audio would encode
# to the same codes (one semantic entry, acoustic level 10) and a clone would not depend on its reference.
ENCODER_OUTPUT_GAIN = 100.0
INIT_STD = 0.2


def params() -> dict[str, Any]:
    """``params.json``: Mistral's text-model fields and the ``multimodal`` audio sections."""
    return {
        "model_type": "voxtral_tts",  # what VoxtralTTSConfigParser recognises
        "dim": LM_DIM,
        "n_layers": 2,
        "head_dim": 32,
        "hidden_dim": 128,
        "n_heads": 2,
        "n_kv_heads": 1,
        "vocab_size": TEXT_VOCAB,
        "rope_theta": 1000000.0,
        "norm_eps": 1e-05,
        "tied_embeddings": True,
        "causal": True,
        "max_seq_len": 65536,  # the audio tokenizer stage's max_model_len in vLLM-Omni's deploy config
        "multimodal": {
            "audio_model_args": {
                "semantic_codebook_size": SEMANTIC_CODEBOOK,
                "acoustic_codebook_size": ACOUSTIC_LEVELS,
                "n_acoustic_codebook": ACOUSTIC_CODEBOOKS,
                "audio_encoding_args": {
                    "codebook_pattern": "parallel",
                    "num_codebooks": 1 + ACOUSTIC_CODEBOOKS,
                    "sampling_rate": SAMPLE_RATE,
                    "frame_rate": FRAME_RATE,
                },
                "acoustic_transformer_args": {
                    "input_dim": LM_DIM,
                    "dim": 64,
                    "n_layers": 2,
                    "head_dim": 32,
                    "hidden_dim": 128,
                    "n_heads": 2,
                    "n_kv_heads": 1,
                    "use_biases": False,
                    "sigma": 1e-05,
                    "n_decoding_steps": 7,  # the parser's default when absent (with a warning)
                },
            },
            "audio_tokenizer_args": {
                "channels": 1,
                "sampling_rate": SAMPLE_RATE,
                "pretransform_patch_size": PATCH,
                "patch_proj_kernel_size": 7,
                "semantic_codebook_size": SEMANTIC_CODEBOOK,
                "semantic_dim": 16,
                "acoustic_codebook_size": ACOUSTIC_LEVELS,
                "acoustic_dim": ACOUSTIC_CODEBOOKS,
                "conv_weight_norm": True,
                "causal": True,
                "attn_sliding_window_size": 16,
                "half_attn_window_upon_downsampling": True,
                "dim": 32,
                "hidden_dim": 64,
                "head_dim": 16,
                "n_heads": 2,
                "n_kv_heads": 2,
                "qk_norm_eps": 1e-06,
                "qk_norm": True,
                "use_biases": False,
                "norm_eps": 0.01,
                "layer_scale": True,
                "layer_scale_init": 0.01,
                "encoder_transformer_lengths_str": "1,1,1,1",
                "encoder_convs_kernels_str": "4,4,4,3",
                "encoder_convs_strides_str": "2,2,2,1",
                "decoder_transformer_lengths_str": "1,1,1,1",
                "decoder_convs_kernels_str": "3,4,4,4",
                "decoder_convs_strides_str": "1,2,2,2",
                "voice": {name: vid for name, (vid, _) in VOICES.items()},
            },
        },
    }


def tekken() -> dict[str, Any]:
    """``tekken.json``: 1000 specials (the real ids where they matter), 256 bytes then printable-ASCII pairs."""
    specials = {rank: name for name, rank in SPECIAL_RANKS.items()}
    top = max(specials) + 1  # mistral_common fills the ranks after the listed ones with <SPECIAL_N>
    special_tokens = [
        {"rank": r, "token_str": specials.get(r, f"<SPECIAL_{r}>"), "is_control": True} for r in range(top)
    ]
    printable = [bytes([c]) for c in range(32, 127)]
    pieces = [bytes([i]) for i in range(256)] + [a + b for a in printable for b in printable]
    pieces = pieces[: TEXT_VOCAB - NUM_SPECIAL_TOKENS]
    vocab = []
    for rank, piece in enumerate(pieces):
        try:
            text: str | None = piece.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        vocab.append({"rank": rank, "token_bytes": base64.b64encode(piece).decode(), "token_str": text})
    return {
        "config": {
            "pattern": PATTERN,
            "num_vocab_tokens": len(vocab),
            "default_vocab_size": TEXT_VOCAB,
            "default_num_special_tokens": NUM_SPECIAL_TOKENS,
            "version": "v7",
        },
        "vocab": vocab,
        "special_tokens": special_tokens,
        "audio": {
            "sampling_rate": SAMPLE_RATE,
            "frame_rate": FRAME_RATE,
            # Only for speech-to-text (mel features); mistral_common requires the section.
            "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400},
            "voice_num_audio_tokens": {name: n for name, (_, n) in VOICES.items()},
        },
    }


def parsed_config(path: pathlib.Path) -> Any:
    """``path``'s ``params.json`` read by vLLM-Omni's parser: the ``VoxtralTTSConfig`` vLLM-Omni serves with."""
    from vllm_omni.transformers_utils.parsers.voxtral_tts import VoxtralTTSConfigParser

    _, config = VoxtralTTSConfigParser().parse(str(path), trust_remote_code=False)
    return config


def _lm_state(p: dict[str, Any]) -> dict[str, Any]:
    """The Mistral LM under Mistral's names (vLLM's ``MistralForCausalLM.mistral_mapping`` reads them)."""
    import torch

    dim, hd, hidden = p["dim"], p["head_dim"], p["hidden_dim"]
    q, kv = p["n_heads"] * hd, p["n_kv_heads"] * hd
    state: dict[str, torch.Tensor] = {}
    for layer in range(p["n_layers"]):
        shapes = {
            "attention.wq": (q, dim),
            "attention.wk": (kv, dim),
            "attention.wv": (kv, dim),
            "attention.wo": (dim, q),
            "feed_forward.w1": (hidden, dim),
            "feed_forward.w2": (dim, hidden),
            "feed_forward.w3": (hidden, dim),
        }
        for name, shape in shapes.items():
            state[f"layers.{layer}.{name}.weight"] = torch.randn(shape) * (1 / shape[1] ** 0.5)
        state[f"layers.{layer}.attention_norm.weight"] = torch.ones(dim)
        state[f"layers.{layer}.ffn_norm.weight"] = torch.ones(dim)
    state["norm.weight"] = torch.ones(dim)
    state["mm_audio_embeddings.tok_embeddings.weight"] = torch.randn(p["vocab_size"], dim) * INIT_STD
    return state


def _acoustic_transformer(config: Any) -> Any:
    """vLLM-Omni's ``FlowMatchingAudioTransformer``: its [END_AUDIO] semantic row widened, its acoustic codes made
    independent of the flow-matching noise (see the constants)."""
    import torch
    from vllm_omni.model_executor.models.voxtral_tts.voxtral_tts_audio_generation import (
        FlowMatchingAudioTransformer,
    )

    model = FlowMatchingAudioTransformer(copy.deepcopy(config.audio_config["audio_model_args"]))
    with torch.no_grad():
        model.semantic_codebook_output.weight[END_AUDIO] *= END_AUDIO_ROW_SCALE
        model.input_projection.weight.zero_()
        model.acoustic_codebook_output.weight *= ACOUSTIC_HEAD_SCALE
    return model


def _audio_tokenizer(config: Any) -> Any:
    """vLLM-Omni's ``VoxtralTTSAudioTokenizer`` (built as vLLM-Omni builds it), with a random semantic codebook and
    an encoder whose output spans the codebooks (see ``ENCODER_OUTPUT_GAIN``)."""
    from types import SimpleNamespace

    import torch
    from vllm_omni.model_executor.models.voxtral_tts.voxtral_tts_audio_tokenizer import VoxtralTTSAudioTokenizer

    # Its constructor reads nothing of the vLLM config but the model's HF config.
    model = VoxtralTTSAudioTokenizer(vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=config)))
    with torch.no_grad():
        # A zero codebook (the module's start) would decode every semantic code to the same sound.
        model.quantizer.semantic_codebook.embedding_sum.normal_(0.0, 1.0)
        model.quantizer.semantic_codebook.cluster_usage.fill_(1.0)
        model.audio_token_embedding.embeddings.weight.normal_(0.0, INIT_STD)
        model.encoder_blocks[-1].conv.parametrizations.weight.original0.mul_(ENCODER_OUTPUT_GAIN)
    return model


def _voice_embedding(tokenizer: Any, frames: int) -> Any:
    """A preset voice as the real ones are made: the codebook embeddings of a reference's codes, summed.

    The codes are random frames (a semantic code and 36 acoustic levels each, offset past the audio
    specials): what the encoder would make of some recording."""
    import torch

    semantic = torch.randint(AUDIO_SPECIALS, AUDIO_SPECIALS + SEMANTIC_CODEBOOK, (1, 1, frames))
    acoustic = torch.randint(AUDIO_SPECIALS, AUDIO_SPECIALS + ACOUSTIC_LEVELS, (1, ACOUSTIC_CODEBOOKS, frames))
    with torch.no_grad():
        (embedding,) = tokenizer.encode_tokens([torch.cat([semantic, acoustic], dim=1)])
    return embedding.to(torch.bfloat16).contiguous()


def build_tiny_voxtral_tts(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny checkpoint (params, tokenizer, weights, preset voices) to ``path``."""
    import torch
    from safetensors.torch import save_file

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    p = params()
    (out / "params.json").write_text(json.dumps(p, indent=2, sort_keys=True) + "\n")
    (out / "tekken.json").write_text(json.dumps(tekken(), indent=1, ensure_ascii=False) + "\n")
    config = parsed_config(out)
    # Seed a private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        state = _lm_state(p)
        acoustic = _acoustic_transformer(config)
        tokenizer = _audio_tokenizer(config)
        voices = {name: _voice_embedding(tokenizer, frames) for name, (_, frames) in VOICES.items()}
    for name, tensor in acoustic.named_parameters():
        state[f"acoustic_transformer.{name}"] = tensor
    codebook_embeddings = "audio_token_embedding.embeddings.weight"
    for name, tensor in [*tokenizer.named_parameters(), *tokenizer.named_buffers()]:
        if name == codebook_embeddings:
            state["mm_audio_embeddings.audio_codebook_embeddings.embeddings.weight"] = tensor
        elif name.startswith("quantizer.semantic_codebook.") and not name.endswith("_embedding"):
            state[f"audio_tokenizer.{name}"] = tensor  # the two persistent buffers its loader sets
        elif name in dict(tokenizer.named_parameters()):
            state[f"audio_tokenizer.{name}"] = tensor
    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise RuntimeError(f"tiny Voxtral TTS: tensor {name} is not finite")
    weights = {name: t.detach().to(torch.bfloat16).contiguous().clone() for name, t in sorted(state.items())}
    save_file(weights, out / "consolidated.safetensors", metadata={"format": "pt"})
    (out / "voice_embedding").mkdir()
    for name, embedding in voices.items():
        torch.save(embedding, out / "voice_embedding" / f"{name}.pt")
    (out / _MARKER).write_text(json.dumps({"name": TINY_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def ensure_tiny_voxtral_tts(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny checkpoint, building it on first use (see :mod:`omni_serve.checkpoints.cache`)."""
    return ensure_checkpoint(TINY_NAME, build_tiny_voxtral_tts, _MARKER, BUILD_VERSION, cache_dir)
