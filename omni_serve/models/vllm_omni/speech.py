"""A TTS entry stage's prompt for a ``/v1/audio/speech`` request, built by vLLM-Omni's own TTS adapter.

A TTS model's entry stage takes no chat template: vLLM-Omni's speech server builds its prompt per model, in
the model's TTS adapter (``entrypoints/openai/tts_adapters``: Qwen3-TTS's placeholder ids and
``additional_information``, Voxtral's Mistral speech request tokens, ...). The adapter is found as vLLM-Omni
finds it, from the stage's declaration (``detect_tts_model_type(model_stage, model_arch)``), and
:class:`AdapterPrompts` runs it on vLLM-Omni's own request model (``OpenAICreateSpeechRequest``) in the order
the speech server does (``OmniOpenAIServingSpeech._prepare_speech_generation``): ``validate``, ``build``,
``apply_sampling_overrides``, then the request's seed also as ``extra_args.tts_local_seed``.

The adapter reads a few helpers off its speech server (``ctx.server``: the speakers, an uploaded voice's
time, the instructions' limit, its tokenizer, reference audio resolution). Its server is vLLM-Omni's
``OmniOpenAIServingSpeech``, made without its API-server ``__init__`` (an engine client, served models,
uploaded voices restored from disk), as vLLM-Omni's own ``OmniOpenAIServingSpeech.for_diffusion`` makes
one: here with no uploaded voices (omni_serve has no voice upload route), and an engine client that is this
stage's engine (its model config, and its workers for the adapter's control calls: Voxtral asks them whether
the codec's encoder is loaded).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from omni_serve.exceptions import InvalidStageInput
from omni_serve.types import StageRequest

# The /v1/audio/speech fields (vLLM-Omni's names) adapters read besides ``input`` and ``voice``.
FIELDS = ("task_type", "language", "instructions", "ref_audio", "ref_text", "x_vector_only_mode", "max_new_tokens")

# The reference audios a replica keeps decoded (vLLM-Omni's speech server keeps 1024 / 512 MiB): Qwen3-TTS's
# adapter marks a request whose reference is cached (``_qwen3_tts_ref_audio_cache_key``) so the talker reuses
# its codes.
REF_AUDIO_CACHE_ENTRIES = 64
REF_AUDIO_CACHE_BYTES = 64 * 1024 * 1024

# (method name, its arguments) -> what each of the stage's workers returned: the engine's collective RPC.
Rpc = Callable[..., Awaitable[Any]]


class AdapterPrompts:
    """One TTS entry stage's prompts, built by vLLM-Omni's adapter for the stage (the module docstring)."""

    def __init__(self, vllm_config: Any, declared: Any, rpc: Rpc):
        from collections import OrderedDict

        from vllm_omni.entrypoints.openai.serving_speech import OmniOpenAIServingSpeech
        from vllm_omni.entrypoints.openai.tts_adapters import (
            SpeechServingContext,
            detect_tts_model_type,
            resolve_adapter,
        )

        model_config = vllm_config.model_config
        architectures = getattr(model_config, "architectures", None) or [None]
        adapter_class = resolve_adapter(detect_tts_model_type(declared.model_stage, architectures[0]))
        if adapter_class is None:
            raise ValueError(f"vLLM-Omni has no TTS adapter for stage {declared.model_stage!r}")

        engine_client = SimpleNamespace(model_config=model_config, collective_rpc=rpc)
        server = OmniOpenAIServingSpeech.__new__(OmniOpenAIServingSpeech)
        server.engine_client = engine_client
        server.model_config = model_config
        server.uploaded_speakers = {}
        server._tts_stage = SimpleNamespace(stage_pipeline_config=declared)  # where tts_args are declared
        server._tts_tokenizer = None  # each adapter loads the tokenizer it builds prompts with, as on the server
        server._tts_executor = None  # the adapter's blocking work on the event loop's default executor
        server._ref_audio_resolve_cache = OrderedDict()
        server._ref_audio_resolve_cache_bytes = 0
        server._ref_audio_resolve_cache_max_entries = REF_AUDIO_CACHE_ENTRIES
        server._ref_audio_resolve_cache_max_bytes = REF_AUDIO_CACHE_BYTES
        server._ref_audio_model_artifact_ready = set()
        server._adapter = adapter_class(SpeechServingContext(server=server, engine_client=engine_client))
        server._adapter.load_capabilities()
        server._max_instructions_length = server._compute_max_instructions_length()
        self.adapter = server._adapter

    def speakers(self) -> list[str]:
        """The voices the adapter accepts by name (lower case), as the speech server lists them."""
        capabilities = self.adapter.capabilities
        return sorted({str(s).lower() for s in (*capabilities.supported_speakers, *capabilities.precomputed_speakers)})

    async def prompt(self, request: StageRequest, params: Any) -> dict[str, Any]:
        """The entry stage's prompt for ``request`` (its text to speak, voice and speech fields), and ``params``
        changed as vLLM-Omni's speech server changes the stage's; a request the adapter refuses is a 400 with its
        reason."""
        from vllm_omni.entrypoints.openai.protocol.audio import OpenAICreateSpeechRequest

        fields = {k: v for k, v in (request.speech or {}).items() if v is not None}
        speech = OpenAICreateSpeechRequest(input=request.text_to_speak or "", voice=request.voice, **fields)
        inline_reference = speech.ref_audio is not None  # captured before validate(), as the server does
        error = self.adapter.validate(speech)
        if error:
            raise InvalidStageInput(error, _field_named(error))
        try:
            prepared = await self.adapter.build(speech, [params], inline_reference)
        except ValueError as err:  # a reference audio that does not decode, or one the checkpoint cannot clone
            if inline_reference:
                raise InvalidStageInput(f"ref_audio: {err}", "ref_audio") from None
            raise InvalidStageInput(str(err), _field_named(str(err))) from None
        prompt = prepared.prompt
        (adjusted,) = self.adapter.apply_sampling_overrides([params], speech, prompt)
        for name in ("max_tokens", "min_tokens", "extra_args"):
            setattr(params, name, getattr(adjusted, name))
        if request.sampling.seed is not None:  # the server's: the request's seed also seeds a model's local RNG
            params.extra_args = {**(params.extra_args or {}), "tts_local_seed": request.sampling.seed}
        return prompt


def _field_named(error: str) -> str | None:
    """The request field an adapter's refusal names, for the 400's ``param``: one it quotes ('instructions'),
    else one it mentions (Invalid voice 'x')."""
    names = ("voice", "language", *FIELDS, "speaker_embedding", "input")
    lowered = error.lower()
    quoted = [name for name in names if f"'{name}'" in lowered or f"{name}=" in lowered]
    mentioned = [name for name in names if f" {name} " in f" {lowered} "]
    return next(iter(quoted + mentioned), None)
