"""Ming-flash-omni (vLLM-Omni pipelines ``ming_flash_omni*``): what its declarations do not say.

Its standalone TTS (``ming_flash_omni_tts``: the talker alone, text to speak in) takes a prompt of its own: vLLM-Omni's
Ming-flash-omni TTS adapter (``tts_adapters/ming_flash_omni_tts.py``, ``MingFlashOmniTTSAdapter``: the ``instruct``
task, the text and its caption in ``additional_information``, a one-token placeholder prompt), run by
:class:`omni_serve.models.vllm_omni.speech.AdapterPrompts`. The speech-to-speech pipeline's talker speaks the
thinker's text through the declared ``thinker2talker_token_only`` and needs no hook.
"""

from __future__ import annotations

from omni_serve.models.vllm_omni.hooks import PipelineHooks
from omni_serve.models.vllm_omni.speech import AdapterPrompts

MING_FLASH_OMNI_TTS = PipelineHooks(speech_prompt=AdapterPrompts)
