"""The tiny random-weight Ming-flash-omni 2.0 checkpoint (vLLM-Omni pipeline ``ming_flash_omni``), thinker and talker.

Ming-flash-omni is a thinker (a BailingMoeV2 mixture-of-experts LLM with multimodal routers, a
Qwen3-VL vision encoder, a Whisper audio encoder and their projectors) and a talker that speaks the
thinker's *text*: its own Qwen2 LLM reads the text, and each step a CFM (a DiT integrated over
``steps`` flow-matching steps) turns the LLM's last hidden state into ``patch_size`` continuous
latents, an aggregator (another DiT) folds them back into the LLM's input, a stop head ends the
reply, and an AudioVAE decodes the latents to 44.1 kHz audio. vLLM-Omni 0.30 ships the whole
architecture (``vllm_omni.model_executor.models.ming_flash_omni``, ``models.common.ming``).

The layout is the released ``inclusionAI/Ming-flash-omni-2.0``'s, read by vLLM-Omni:

- the root: ``config.json`` (``BailingMM2Config``, model type ``bailingmm_moe_v2_lite``: ``llm_config``,
  ``vision_config``, ``audio_config``), the thinker's weights (``model.safetensors``: ``model.*`` the
  LLM, ``vision.*``, ``audio.*``, ``linear_proj.*``, ``linear_proj_audio.*``, under the names
  vLLM-Omni's loaders map), the thinker's tokenizer and chat template, and the processor files
  (``MingFlashOmniProcessor``: Qwen2-VL image and video processors, ``MingWhisperFeatureExtractor``);
- ``talker/``: ``config.json`` (``MingFlashOmniTalkerConfig``), ``model.safetensors`` (the talker's
  modules under their own names), ``llm/`` (the Qwen2 config and the talker's tokenizer) and ``vae/``
  (``AudioVAEConfig`` and weights).

The modules are vLLM-Omni's own (``WhisperAudioEncoder``, the projectors, ``CFM``/``DiT``,
``Aggregator``, ``AudioVAE``) or transformers' where vLLM-Omni loads the official layout
(``Qwen2Model`` for the talker's LLM, ``Qwen3VLMoeVisionModel`` for the vision tower's names); the
MoE LLM is written tensor by tensor under the names ``BailingMoeV2ForCausalLM.load_weights`` reads
(fused ``query_key_value``, per-expert ``gate_proj``/``up_proj``/``down_proj``, the three routers).

What is kept real: the chat format (``<role>HUMAN</role>`` ..., the system prompt of
``MingFlashOmniProcessor``), the media tokens (``<IMAGE>``/``<AUDIO>``/``<VIDEO>`` placeholders and the
``<image>``/``<imagePatch>``/... runs the processor expands them to), 128 mel bins at 16 kHz (what
Whisper's log-mel takes), video RoPE with a partial rotary factor of 0.5, grouped expert routing
with a shared expert and a dense first layer, MultiRouter gates; the talker's 10 CFM steps, patch 4,
history 32, CFG 2.0, 192-wide speaker embeddings, the AudioVAE's 44.1 kHz, 882-sample hop and VAE patch
4 (so one talker step is 16 x 882 samples, 0.32 s). What is tiny: every width and depth, the text
vocabularies (bytes, filler words and the special tokens), the latent width (16). No voice presets
(``campplus.onnx`` and a manifest of recordings upstream): the talker then speaks with a zero speaker
embedding, as vLLM-Omni's omni path does for an unknown voice.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from omni_serve.checkpoints.cache import ensure_checkpoint

TINY_NAME = "tiny-ming-flash-omni"
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 1
_MARKER = "omni_serve_tiny.json"
_SEED = 2020

THINKER_VOCAB = 1024
# The thinker's special tokens, at the top of its vocabulary (ids THINKER_VOCAB - len .. THINKER_VOCAB - 1).
THINKER_SPECIALS = (
    "<|endoftext|>",
    "<role>",
    "</role>",
    "<IMAGE>",
    "<VIDEO>",
    "<AUDIO>",
    "<image>",
    "</image>",
    "<imagePatch>",
    "<video>",
    "</video>",
    "<framePatch>",
    "<audio>",
    "</audio>",
    "<audioPatch>",
)
FIRST_THINKER_SPECIAL = THINKER_VOCAB - len(THINKER_SPECIALS)
THINKER_IDS = {token: FIRST_THINKER_SPECIAL + i for i, token in enumerate(THINKER_SPECIALS)}
# The talker's Qwen2 tokenizer: bytes, then what its prompt builder (``build_tts_input``) encodes as one token.
TALKER_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<audio>",
    "<audioPatch>",
)
TALKER_VOCAB = 256 + len(TALKER_SPECIALS)
# MingFlashOmniProcessor's system prompt and roles (transformers_utils/processors/ming.py), as a chat template.
SYSTEM_PROMPT = "你是一个友好的AI助手。"
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='" + SYSTEM_PROMPT + "') -%}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{%- set ns.system = message['content'] if message['content'] is string else message['content'][0]['text'] -%}"
    "{%- endfor -%}"
    "{{- '<role>SYSTEM</role>' + ns.system + '\\n\\ndetailed thinking off<|endoftext|>' -}}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{{- '<role>HUMAN</role>' if message['role'] == 'user' else '<role>ASSISTANT</role>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{- '<IMAGE>' -}}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') -%}{{- '<AUDIO>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '<VIDEO>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|endoftext|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<role>ASSISTANT</role>' -}}{%- endif -%}"
)

HIDDEN = 64
HEAD_DIM = 32  # the smallest head size vLLM's CPU attention takes
NUM_MEL_BINS = 128  # what whisper.log_mel_spectrogram computes (80 or 128)
VAE_SAMPLE_RATE = 44100
VAE_HOP = 882
LATENT_DIM = 16
SPEAKER_EMBEDDING_DIM = 192  # vLLM-Omni's ming_tts.constants: CAMPPlus' width, the speaker head's input
INIT_STD = 0.2


def llm_config() -> dict[str, Any]:
    """The thinker's ``BailingMoeV2Config`` (as a dict of ``config.json``'s ``llm_config``)."""
    t = THINKER_IDS
    return {
        "model_type": "bailing_moe_v2",
        "vocab_size": THINKER_VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "use_qkv_bias": False,
        "use_bias": False,
        "use_qk_norm": True,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_theta": 600000.0,
        # Ming's video RoPE over the rotary half of each head (partial_rotary_factor 0.5): 16 rotary dims, so the
        # T/H/W sections split 8 frequencies as the real [8, 12, 12] splits 32.
        "rope_scaling": {"type": "video_rope", "mrope_section": [2, 3, 3]},
        "partial_rotary_factor": 0.5,
        "num_experts": 4,
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "router_type": "MultiRouter",
        "pad_token_id": t["<|endoftext|>"],
        "eos_token_id": t["<|endoftext|>"],
        "image_patch_token": t["<imagePatch>"],
        "image_start_token": t["<image>"],
        "image_end_token": t["</image>"],
        "video_patch_token": t["<framePatch>"],
        "video_start_token": t["<video>"],
        "video_end_token": t["</video>"],
        "audio_patch_token": t["<audioPatch>"],
        "audio_start_token": t["<audio>"],
        "audio_end_token": t["</audio>"],
        "spatial_merge_size": 2,
        "tokens_per_second": 2,
        "initializer_range": INIT_STD,
    }


def whisper_encoder_config() -> dict[str, Any]:
    """``audio_config.whisper_encoder_config``: vLLM-Omni's ``WhisperAudioEncoder`` arguments."""
    return {"n_mels": NUM_MEL_BINS, "n_ctx": 1500, "n_state": 16, "n_head": 2, "n_layer": 1}


def vision_config() -> dict[str, Any]:
    """``vision_config``: the Qwen3-VL vision tower at the tiny Qwen3-Omni's vision sizes (one token per 8x8 px)."""
    from omni_serve.checkpoints.tiny_omni import VISION_IMAGE_SIZE, VISION_MERGE, VISION_PATCH

    return {
        "depth": 1,
        "hidden_size": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 32,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": VISION_PATCH,
        "spatial_merge_size": VISION_MERGE,
        "temporal_patch_size": 2,
        "out_hidden_size": 32,
        "num_position_embeddings": (VISION_IMAGE_SIZE // VISION_PATCH) ** 2,
        "deepstack_visual_indexes": [0],
    }


def thinker_config() -> dict[str, Any]:
    """The root ``config.json`` (``BailingMM2Config``)."""
    return {
        "model_type": "bailingmm_moe_v2_lite",
        "architectures": ["BailingMM2NativeForConditionalGeneration"],
        "dtype": "bfloat16",
        "mlp_depth": 2,
        "llm_config": llm_config(),
        "vision_config": vision_config(),
        "audio_config": {
            "whisper_encoder_config": whisper_encoder_config(),
            "ds_kernel_size": 3,
            "ds_stride": 2,
            "norm_query_embeds": True,
        },
    }


def talker_llm_config() -> dict[str, Any]:
    """``talker/llm/config.json``: the talker's Qwen2 LLM."""
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2Model"],
        "vocab_size": TALKER_VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "bos_token_id": 256,
        "eos_token_id": 258,
        "initializer_range": INIT_STD,
        "dtype": "bfloat16",
    }


def _dit(depth: int = 1) -> dict[str, Any]:
    # One shape for the CFM's DiT and the aggregator (as the real ones share theirs), no attention masks.
    return {
        "hidden_size": 32,
        "depth": depth,
        "num_heads": 2,
        "mlp_ratio": 2,
        "in_channels": LATENT_DIM,
        "dropout": 0.0,
        "attn_mask_enabled": False,
    }


def talker_config() -> dict[str, Any]:
    """``talker/config.json`` (``MingFlashOmniTalkerConfig``); the LLM's config lives in ``talker/llm``."""
    return {
        "model_type": "ming_flash_omni_talker",
        "flowmodel": {**_dit(), "llm_cond_dim": HIDDEN},
        "aggregator": _dit(),
        "steps": 10,
        "patch_size": 4,
        "history_patch_size": 32,
        "latent_dim": LATENT_DIM,
        "cfg_strength": 2.0,
    }


def vae_config() -> dict[str, Any]:
    """``talker/vae/config.json`` (``AudioVAEConfig``): Qwen2 backbones, 882-sample hop, VAE patch 4 at 44.1 kHz."""
    backbone = {
        "vocab_size": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": INIT_STD,
    }
    return {
        "model_type": "audio_vae",
        "sample_rate": VAE_SAMPLE_RATE,
        "patch_size": 4,
        "init_method": "normal",
        # The encoder's patch aggregator is its backbone's config with num_hidden_layers set to 4 (``audio_vae.py``),
        # and transformers sizes ``layer_types`` from the backbone's count: the backbone needs 4 layers or more.
        "enc_kwargs": {
            "backbone": {**backbone, "num_hidden_layers": 4},
            "input_dim": VAE_HOP,
            "hop_size": VAE_HOP,
            "latent_dim": LATENT_DIM,
        },
        "dec_kwargs": {"backbone": backbone, "output_dim": VAE_HOP, "latent_dim": LATENT_DIM},
    }


def processor_files() -> dict[str, dict[str, Any]]:
    """The processor's JSON files: ``MingFlashOmniProcessor`` with Qwen2-VL image/video and Ming's Whisper features.

    The image processor and the feature extractor both read ``preprocessor_config.json`` (each takes its own
    keys), as in the tiny Qwen3-Omni; sizes match the tiny encoders."""
    from omni_serve.checkpoints import tiny_omni

    vision = tiny_omni.vision_processor_config()
    video = tiny_omni.processor_files()["video_preprocessor_config.json"]
    return {
        "preprocessor_config.json": {
            "feature_extractor_type": "MingWhisperFeatureExtractor",
            "feature_size": NUM_MEL_BINS,
            "sampling_rate": 16000,
            **vision,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "MingFlashOmniProcessor",
        },
        "video_preprocessor_config.json": {**video, "processor_class": "MingFlashOmniProcessor"},
    }


def build_thinker_tokenizer() -> Any:
    """Bytes, filler words (a space and letters) and the special tokens at the top; Ming's chat template."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from omni_serve.checkpoints.tiny_omni import _byte_level_tokenizer, _check_ids, filler_word

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for token_id in range(256, FIRST_THINKER_SPECIAL):
        vocab[filler_word(token_id)] = token_id
    for token, token_id in THINKER_IDS.items():
        vocab[token] = token_id
    tok = _byte_level_tokenizer(vocab, [(token, True) for token in THINKER_SPECIALS])
    _check_ids(tok, THINKER_IDS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_talker_tokenizer() -> Any:
    """Bytes and the special tokens the talker's prompt builder asks for as single tokens."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from omni_serve.checkpoints.tiny_omni import _byte_level_tokenizer, _check_ids

    byte_chars = bytes_to_unicode()
    ids = {token: 256 + i for i, token in enumerate(TALKER_SPECIALS)}
    tok = _byte_level_tokenizer({byte_chars[b]: b for b in range(256)}, [(t, True) for t in TALKER_SPECIALS])
    _check_ids(tok, ids)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def _moe_llm_state(cfg: dict[str, Any]) -> dict[str, Any]:
    """The BailingMoeV2 LLM under the names ``BailingMoeV2ForCausalLM.load_weights`` reads (prefix ``model.``)."""
    import torch

    def linear(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp) * (1 / inp**0.5)

    h, hd = cfg["hidden_size"], cfg["head_dim"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    state: dict[str, torch.Tensor] = {
        "model.model.word_embeddings.weight": torch.randn(cfg["vocab_size"], h) * INIT_STD
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.model.layers.{i}."
        state[p + "input_layernorm.weight"] = torch.ones(h)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
        state[p + "attention.query_key_value.weight"] = linear(qkv, h)
        state[p + "attention.dense.weight"] = linear(h, cfg["num_attention_heads"] * hd)
        state[p + "attention.q_norm.weight"] = torch.ones(hd)
        state[p + "attention.k_norm.weight"] = torch.ones(hd)
        if i < cfg["first_k_dense_replace"]:
            mlps = {"mlp.": cfg["intermediate_size"]}
        else:
            moe = cfg["moe_intermediate_size"]
            mlps = {f"mlp.experts.{e}.": moe for e in range(cfg["num_experts"])}
            mlps["mlp.shared_experts."] = moe * cfg["num_shared_experts"]
            for gate in ("gate", "image_gate", "audio_gate"):  # MultiRouter: text, image and audio tokens
                state[p + f"mlp.{gate}.weight"] = linear(cfg["num_experts"], h)
                state[p + f"mlp.{gate}.expert_bias"] = torch.zeros(cfg["num_experts"])
        for prefix, width in mlps.items():
            state[p + prefix + "gate_proj.weight"] = linear(width, h)
            state[p + prefix + "up_proj.weight"] = linear(width, h)
            state[p + prefix + "down_proj.weight"] = linear(h, width)
    state["model.model.norm.weight"] = torch.ones(h)
    head = torch.randn(cfg["vocab_size"], h) * INIT_STD
    # Zero the rows of non-printable bytes and special tokens: a zero row's logit 0 is far below the top random
    # logit, so the thinker's text is printable (bytes and filler words) and ends at max_tokens, not on EOS.
    rows = [b for b in range(256) if not 0x20 <= b < 0x7F] + list(range(FIRST_THINKER_SPECIAL, cfg["vocab_size"]))
    head[rows] = 0.0
    state["model.lm_head.weight"] = head
    return state


def _thinker_state(config: dict[str, Any]) -> dict[str, Any]:
    """All the thinker's tensors: the LLM, the vision tower (Qwen3-VL names), the Whisper encoder, the projectors."""
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel
    from vllm_omni.model_executor.models.ming_flash_omni.audio_encoder import WhisperAudioEncoder
    from vllm_omni.model_executor.models.ming_flash_omni.projectors import AudioProjector, VisionProjector

    state = _moe_llm_state(config["llm_config"])
    vision_cfg = config["vision_config"]
    vision = Qwen3VLMoeVisionModel._from_config(Qwen3VLMoeVisionConfig(**vision_cfg, initializer_range=INIT_STD))
    audio_cfg = config["audio_config"]
    audio = WhisperAudioEncoder(**audio_cfg["whisper_encoder_config"], use_flash_attn=False)
    modules = {
        "vision.": vision,
        "audio.": audio,
        "linear_proj.": VisionProjector(vision_cfg["out_hidden_size"], HIDDEN, mlp_depth=config["mlp_depth"]),
        "linear_proj_audio.": AudioProjector(
            audio_cfg["whisper_encoder_config"]["n_state"],
            HIDDEN,
            ds_kernel_size=audio_cfg["ds_kernel_size"],
            ds_stride=audio_cfg["ds_stride"],
            mlp_depth=config["mlp_depth"],
        ),
    }
    for prefix, module in modules.items():
        state.update({prefix + name: tensor for name, tensor in module.named_parameters()})
    return state


def _talker_modules(talker: dict[str, Any], llm: dict[str, Any]) -> dict[str, Any]:
    """The talker's modules as ``MingFlashOmniTalkerForConditionalGeneration`` builds them, by attribute name."""
    import torch
    from transformers import Qwen2Config, Qwen2Model
    from vllm_omni.model_executor.models.common.ming.aggregator import Aggregator
    from vllm_omni.model_executor.models.ming_flash_omni.talker_module import CFM, DiT

    return {
        "model": Qwen2Model(Qwen2Config(**llm)),
        "cfm": CFM(DiT(llm_input_dim=HIDDEN, **talker["flowmodel"]), steps=talker["steps"]),
        "aggregator": Aggregator(llm_input_dim=HIDDEN, **talker["aggregator"]),
        "stop_head": torch.nn.Linear(HIDDEN, 2, bias=True),
        "spk_head": torch.nn.Linear(SPEAKER_EMBEDDING_DIM, HIDDEN, bias=True),
    }


def _audio_vae(vae: dict[str, Any]) -> Any:
    from vllm_omni.model_executor.models.common.ming.audio_vae import AudioVAE, AudioVAEConfig

    return AudioVAE(AudioVAEConfig(**{k: v for k, v in vae.items() if k != "model_type"}))


def _save(state: dict[str, Any], path: pathlib.Path) -> None:
    import torch
    from safetensors.torch import save_file

    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise RuntimeError(f"tiny Ming-flash-omni: tensor {name} is not finite")
    weights = {name: t.detach().to(torch.bfloat16).contiguous().clone() for name, t in sorted(state.items())}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, path, metadata={"format": "pt"})


def _write_json(path: pathlib.Path, content: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build_tiny_ming_flash_omni(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny checkpoint (thinker, talker, tokenizers, processor files) to ``path``."""
    import torch

    out = pathlib.Path(path)
    config, talker, llm, vae = thinker_config(), talker_config(), talker_llm_config(), vae_config()
    # Seed a private generator state: the build must not depend on (or disturb) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        thinker_state = _thinker_state(config)
        talker_state = {
            f"{prefix}.{name}": tensor
            for prefix, module in _talker_modules(talker, llm).items()
            for name, tensor in module.named_parameters()
        }
        vae_state = dict(_audio_vae(vae).named_parameters())
    _write_json(out / "config.json", config)
    _save(thinker_state, out / "model.safetensors")
    build_thinker_tokenizer().save_pretrained(out)
    for name, content in processor_files().items():
        _write_json(out / name, content)
    _write_json(out / "talker" / "config.json", talker)
    _save(talker_state, out / "talker" / "model.safetensors")
    _write_json(out / "talker" / "llm" / "config.json", llm)
    build_talker_tokenizer().save_pretrained(out / "talker" / "llm")
    _write_json(out / "talker" / "vae" / "config.json", vae)
    _save(vae_state, out / "talker" / "vae" / "model.safetensors")
    (out / _MARKER).write_text(json.dumps({"name": TINY_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def ensure_tiny_ming_flash_omni(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny checkpoint, building it on first use (see :mod:`omni_serve.checkpoints.cache`)."""
    return ensure_checkpoint(TINY_NAME, build_tiny_ming_flash_omni, _MARKER, BUILD_VERSION, cache_dir)
