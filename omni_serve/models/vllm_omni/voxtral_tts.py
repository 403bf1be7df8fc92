"""Voxtral TTS (vLLM-Omni pipeline ``voxtral_tts``): what its declaration does not say.

Its audio-generation LM's prompt is vLLM-Omni's Voxtral adapter's (``tts_adapters/voxtral.py``,
``VoxtralTTSAdapter``: mistral_common's speech request tokens, the preset voice named in
``additional_information``), run by :class:`omni_serve.models.vllm_omni.speech.AdapterPrompts`.
Nothing else: its async-chunk processor (``generator2tokenizer_async_chunk``) already cuts each chunk with
its left context in the chunk itself (``[context frames, new frames, codes...]``), and the audio tokenizer
cuts the context's samples itself, so each chunk is a stateless audio-tokenizer call as declared.
"""

from __future__ import annotations

from omni_serve.models.vllm_omni.hooks import PipelineHooks
from omni_serve.models.vllm_omni.speech import AdapterPrompts

VOXTRAL_TTS = PipelineHooks(speech_prompt=AdapterPrompts)
