"""The tiny random-weight Qwen3 text checkpoint (``model: tiny-qwen3``) for running real vLLM on a CPU.

A real ``Qwen3ForCausalLM`` (hidden 128, 2 layers, head_dim 64: vLLM's CPU attention
rejects head_dim 16) with the byte-level tokenizer and ChatML template of the tiny
Qwen3-Omni (:func:`omni_serve.checkpoints.tiny_omni.build_byte_tokenizer`). Built deterministically
(fixed seed) on first use and cached under ``$OMNI_SERVE_CACHE/tiny-qwen3``.

Generation is made test-friendly, not meaningful: the output head only has weight on
printable ASCII bytes, so greedy decoding yields readable text that never contains a
special token. The model never ends on its own: every generation stops at
``max_tokens`` or at a stop string.

    python -m omni_serve.checkpoints tiny-qwen3      # prints the checkpoint path, building it if needed
"""

from __future__ import annotations

import json
import os
import pathlib

from omni_serve.checkpoints.cache import ensure_checkpoint

TINY_LLM_NAME = "tiny-qwen3"
# Bump when the layout below changes: cached checkpoints with another version are rebuilt.
BUILD_VERSION = 2  # 2: the chat template takes tools (tiny_omni.CHAT_TEMPLATE)
_MARKER = "omni_serve_tiny_llm.json"
_SEED = 4321
PRINTABLE_ASCII = range(0x20, 0x7F)  # byte-token ids 32..126 are the printable ASCII characters


def tiny_llm_config():
    """The ``Qwen3Config`` of the tiny checkpoint."""
    from transformers import Qwen3Config

    from omni_serve.checkpoints.tiny_omni import TOKEN_IDS, VOCAB_SIZE

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=TOKEN_IDS["<|endoftext|>"],
        eos_token_id=TOKEN_IDS["<|im_end|>"],
        pad_token_id=TOKEN_IDS["<|endoftext|>"],
        dtype="float32",
    )


def build_tiny_llm(path: str | os.PathLike) -> pathlib.Path:
    """Write the tiny checkpoint and its tokenizer to ``path`` (which must not hold another model)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from omni_serve.checkpoints.tiny_omni import build_byte_tokenizer

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # A private RNG state: the build neither depends on nor disturbs the caller's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = Qwen3ForCausalLM(tiny_llm_config())
        with torch.no_grad():
            head = model.lm_head.weight  # [vocab, hidden]
            allowed = torch.zeros(head.shape[0], dtype=torch.bool)
            allowed[list(PRINTABLE_ASCII)] = True
            # Large weights on printable bytes, none elsewhere: the printable logits dominate
            # the others (logit 0), even under temperature sampling.
            head[allowed] = torch.randn(int(allowed.sum()), head.shape[1]) * 0.5
            head[~allowed] = 0.0
    model.eval()
    model.save_pretrained(out)
    build_byte_tokenizer().save_pretrained(out)
    (out / _MARKER).write_text(json.dumps({"name": TINY_LLM_NAME, "version": BUILD_VERSION, "seed": _SEED}))
    return out


def ensure_tiny_qwen3(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the cached tiny checkpoint, building it on first use. (see :mod:`omni_serve.checkpoints.cache`)."""
    return ensure_checkpoint(TINY_LLM_NAME, build_tiny_llm, _MARKER, BUILD_VERSION, cache_dir)
