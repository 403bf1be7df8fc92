"""Voxtral TTS (vLLM-Omni pipeline ``voxtral_tts``): what its declaration does not say.

Its audio-generation LM's prompt is vLLM-Omni's Voxtral adapter's (``tts_adapters/voxtral.py``,
``VoxtralTTSAdapter``: mistral_common's speech request tokens, the preset voice named in
``additional_information``), run by :class:`omni_serve.models.vllm_omni.speech.AdapterPrompts`.
Its async-chunk processor (``generator2tokenizer_async_chunk``) already cuts each chunk with its left context
in the chunk itself (``[context frames, new frames, codes...]``), and the audio tokenizer cuts the context's
samples itself (``decoder_cuts_left_context``), so each chunk is a stateless audio-tokenizer call as declared:
the edge exists only as async chunks (no whole handoff is declared), and the generator cuts them so.
"""

from __future__ import annotations

from omni_serve.models.vllm_omni.hooks import PipelineHooks, StageHooks
from omni_serve.models.vllm_omni.speech import AdapterPrompts

VOXTRAL_TTS = PipelineHooks(
    stages={"audio_tokenizer": StageHooks(decoder_cuts_left_context=True)}, speech_prompt=AdapterPrompts
)
