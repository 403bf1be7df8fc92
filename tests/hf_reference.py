"""HF transformers' own Qwen3-Omni ``generate``: the independent reference the serving stack is checked against.

Tests compare the stage engines' text and audio with it; ``benchmarks/bench.py`` runs it as the
in-process baseline (it puts the repository root on ``sys.path`` to import this module). It is test
code, so it lives here rather than in the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from omni_serve.checkpoints import resolve
from omni_serve.models import qwen3_omni as q
from omni_serve.types import ChatMessage

_REFERENCE_MODELS: dict[str, Any] = {}  # checkpoint path -> (model, tokenizer), loaded once per process


def hf_reference_generate(
    model_path: str,
    messages: Sequence[ChatMessage | dict],
    max_new_tokens: int = 16,
    max_frames: int = 32,
    voice: str = "ethan",
    seed: int = 0,
    talker_temperature: float = 0.0,
    talker_top_k: int = 50,
    talker_top_p: float = 1.0,
    talker_repetition_penalty: float = 1.0,
    processor_inputs: Any = None,
    use_audio_in_video: bool = False,
    return_audio: bool = True,
    talker_ignore_eos: bool = False,
) -> tuple[str, np.ndarray]:
    """Text and 24 kHz waveform from transformers' own ``generate(return_audio=True)``: the in-process baseline.

    ``model_path`` is a checkpoint path, or a name of :mod:`omni_serve.checkpoints` (``"tiny"``); the loaded
    model is cached per path.
    ``processor_inputs``: the output of the checkpoint's ``Qwen3OmniMoeProcessor`` for a prompt with
    media (used instead of templating ``messages``). ``return_audio=False``: the text only (the
    waveform is empty).

    The thinker decodes greedily (EOS ``<|im_end|>``/``<|endoftext|>``); ``talker_temperature``
    0 makes the talker's first code group greedy. HF's code predictor always samples the
    residual groups (top_k 50, top_p 0.8), so ``seed`` seeds torch before the call; a
    stage engine seeded the same way consumes the RNG identically (the greedy thinker draws
    nothing). ``max_frames`` maps to ``talker_max_new_tokens = max_frames + 1`` because HF
    gives the last sampled codec token no residual codes. ``talker_ignore_eos`` makes the talker
    run to ``max_frames`` (as a stage's ``ignore_eos`` does), so benchmarks compare equal work.
    """
    import torch
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    model_path = resolve(model_path)
    if model_path not in _REFERENCE_MODELS:
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
        q.give_talker_the_audio_config(model)  # else HF's generate fails on audio + image/video prompts
        _REFERENCE_MODELS[model_path] = (model, AutoTokenizer.from_pretrained(model_path))
    model, tokenizer = _REFERENCE_MODELS[model_path]
    if processor_inputs is None:
        chat = [m.model_dump() if isinstance(m, ChatMessage) else dict(m) for m in messages]
        inputs = dict(
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        )
    else:
        inputs = dict(processor_inputs)
    input_ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    codec_eos = model.config.talker_config.codec_eos_token_id
    torch.manual_seed(seed)
    result = model.generate(
        input_ids,
        **inputs,
        use_audio_in_video=use_audio_in_video,
        speaker=voice,
        return_audio=return_audio,
        thinker_max_new_tokens=max_new_tokens,
        thinker_eos_token_id=eos,
        thinker_do_sample=False,
        talker_max_new_tokens=max_frames + 1,
        talker_do_sample=talker_temperature > 0,
        talker_temperature=talker_temperature if talker_temperature > 0 else 1.0,
        talker_top_k=talker_top_k,
        talker_top_p=talker_top_p,
        talker_repetition_penalty=talker_repetition_penalty,
        # No EOS; the pad id HF would otherwise take from the EOS list (a batch of one is never padded).
        **({"talker_eos_token_id": [], "talker_pad_token_id": codec_eos} if talker_ignore_eos else {}),
    )
    sequences, wav = result if return_audio else (result, torch.zeros(0))
    text = tokenizer.decode(sequences[0, input_ids.shape[1] :], skip_special_tokens=True)
    return text, wav.reshape(-1).float().numpy()
