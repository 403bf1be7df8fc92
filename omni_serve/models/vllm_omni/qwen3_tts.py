"""Qwen3-TTS (vLLM-Omni pipeline ``qwen3_tts``): what its declaration does not say.

Its talker's prompt is vLLM-Omni's Qwen3-TTS adapter's (``tts_adapters/qwen3_tts.py``, ``Qwen3TTSAdapter``:
placeholder token ids as many as the talker's ``preprocess`` makes embeddings for, and
``additional_information``: the text, task type, language, speaker, instructions, reference audio),
run by :class:`omni_serve.models.vllm_omni.speech.AdapterPrompts`; its codec chunks carry their own left
context (:func:`stateless_chunk`).
"""

from __future__ import annotations

from typing import Any

from omni_serve.models.vllm_omni.hooks import PipelineHooks, StageHooks, StepRows
from omni_serve.models.vllm_omni.speech import AdapterPrompts


def stateless_chunk(transfer: Any, payload: Any) -> Any:
    """A codec chunk of vLLM-Omni's Qwen3-TTS async-chunk processor, made for a code2wav call that keeps no state.

    vLLM-Omni's processor (``talker2code2wav_async_chunk``) ships only a chunk's new frames after the first: its
    code2wav, in async-chunk mode, keeps the decoder's context per request (``_decoder_state_cache``, fed by one
    connector), and a last, empty chunk frees it. Here each chunk is its own code2wav call on whichever replica
    takes it, so the chunk carries its context: the ``codec_left_context_frames`` frames before it (the deploy
    config's 72, the decoder's sliding window), a clone's reference codes first (as the whole decode has them),
    counted in ``meta.left_context_size``, whose samples Qwen3TTSCode2Wav cuts itself outside async-chunk mode.
    The first chunk already leads with a clone's reference codes (the processor's). The empty end marker has
    nothing to decode: dropped.
    """
    import torch

    codes = payload.codes.audio if payload.codes is not None else None
    if codes is None or codes.numel() == 0:
        return None
    frames = transfer.code_prompt_token_ids[transfer.request_id]  # the talker's frames so far, [groups] each
    if not frames or int(payload.meta.left_context_size or 0) > 0:
        return payload
    groups = frames[-1].numel()
    new = codes.numel() // groups
    # The processor cut the chunk as the last `new` frames, codebook-major: check it did, as this relies on that.
    if not torch.equal(torch.stack(frames[-new:]).T.reshape(-1), codes.reshape(-1).to(torch.long)):
        raise ValueError("qwen3_tts: a codec chunk is not the talker's last frames (talker2code2wav_async_chunk)")
    wanted = int(transfer.extra.get("codec_left_context_frames", 25))
    ref = transfer.request_payload.get(transfer.request_id)  # a clone's reference codes, kept by the processor
    before = [*(ref.reshape(-1, groups) if isinstance(ref, torch.Tensor) and ref.numel() else ()), *frames[:-new]]
    context = before[len(before) - wanted :] if len(before) > wanted else before
    if context:
        payload.codes.audio = torch.stack([*context, *frames[-new:]]).T.reshape(-1).contiguous()
        payload.meta.left_context_size = len(context)
    return payload


QWEN3_TTS = PipelineHooks(
    # A clone's whole handoff leads with the reference's codes (talker2code2wav_full_payload) and says how many
    # frames (meta.left_context_size); Qwen3TTSCode2Wav.forward cuts their samples itself without async chunks.
    # Its chunks get their left context the same way (stateless_chunk).
    stages={
        # The talker's per-position outputs: its codec frame, and whether that frame is a real one (its async-chunk
        # processor keeps a step's frame only where codec_frame_valid says so: the prompt's rows are not).
        "qwen3_tts": StageHooks(
            step_rows=StepRows(rows=("codes.audio", "meta.codec_frame_valid", "meta.codec_streaming")),
            stateless_chunk=stateless_chunk,
        ),
        "code2wav": StageHooks(decoder_cuts_left_context=True),
    },
    speech_prompt=AdapterPrompts,  # its talker's prompt: vLLM-Omni's Qwen3TTSAdapter
)
