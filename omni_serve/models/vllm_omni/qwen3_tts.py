"""Qwen3-TTS (vLLM-Omni pipeline ``qwen3_tts``): its talker's prompt for a ``/v1/audio/speech`` request.

The talker takes no chat template: vLLM-Omni's speech server builds its prompt per model, in the model's TTS
adapter (``entrypoints/openai/tts_adapters/qwen3_tts.py``, ``Qwen3TTSAdapter``): placeholder token ids as many
as the talker's ``preprocess`` will make embeddings for, and ``additional_information`` (the text, task type,
language, speaker, instructions, reference audio, ...) that it builds them from. :class:`SpeechPrompts` runs
that adapter itself, on vLLM-Omni's own request model (``OpenAICreateSpeechRequest``): the same validation
(task type against the checkpoint, voice, language, instructions' length, Base's reference), the same
prompt, the same talker sampling changes (Base's codec budget by the text's length; the seed also as
``extra_args.tts_local_seed``, the code predictor's).

The adapter reads a few helpers off its speech server (``ctx.server``: the speakers, an uploaded voice's
time, the instructions' limit, the tokenizer, reference audio resolution). Its server is vLLM-Omni's
``OmniOpenAIServingSpeech``, made without its API-server ``__init__`` (an engine client, served models,
uploaded voices restored from disk), as vLLM-Omni's own ``OmniOpenAIServingSpeech.for_diffusion`` makes
one: here with no uploaded voices (omni_serve has no voice upload route).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from omni_serve.models.vllm_omni.hooks import PipelineHooks, StageHooks, StepRows
from omni_serve.types import InvalidStageInput, StageRequest

# The /v1/audio/speech fields (vLLM-Omni's names) the adapter reads besides ``input`` and ``voice``.
FIELDS = ("task_type", "language", "instructions", "ref_audio", "ref_text", "x_vector_only_mode", "max_new_tokens")


# The reference audios a replica keeps decoded (vLLM-Omni's speech server keeps 1024 / 512 MiB): the adapter marks
# a request whose reference is cached (``_qwen3_tts_ref_audio_cache_key``) so the talker reuses its codes.
REF_AUDIO_CACHE_ENTRIES = 64
REF_AUDIO_CACHE_BYTES = 64 * 1024 * 1024


class SpeechPrompts:
    """One talker stage's prompts, built by vLLM-Omni's Qwen3-TTS adapter (the module docstring)."""

    def __init__(self, vllm_config: Any, tokenizer: Any, declared: Any):
        from collections import OrderedDict

        from vllm_omni.entrypoints.openai.serving_speech import OmniOpenAIServingSpeech
        from vllm_omni.entrypoints.openai.tts_adapters.base import SpeechServingContext
        from vllm_omni.entrypoints.openai.tts_adapters.qwen3_tts import Qwen3TTSAdapter

        model_config = vllm_config.model_config
        engine_client = SimpleNamespace(model_config=model_config)
        server = OmniOpenAIServingSpeech.__new__(OmniOpenAIServingSpeech)
        server.engine_client = engine_client
        server.model_config = model_config
        server.uploaded_speakers = {}
        server._tts_stage = SimpleNamespace(stage_pipeline_config=declared)  # where tts_args are declared
        server._tts_tokenizer = tokenizer
        server._tts_executor = None  # the adapter's blocking work on the event loop's default executor
        server._ref_audio_resolve_cache = OrderedDict()
        server._ref_audio_resolve_cache_bytes = 0
        server._ref_audio_resolve_cache_max_entries = REF_AUDIO_CACHE_ENTRIES
        server._ref_audio_resolve_cache_max_bytes = REF_AUDIO_CACHE_BYTES
        server._ref_audio_model_artifact_ready = set()
        server._adapter = Qwen3TTSAdapter(SpeechServingContext(server=server, engine_client=engine_client))
        server._adapter.load_capabilities()
        server._max_instructions_length = server._compute_max_instructions_length()
        self.adapter = server._adapter

    async def prompt(self, request: StageRequest, params: Any) -> dict[str, Any]:
        """The talker's prompt for ``request`` (its text to speak, voice and speech fields), and ``params`` changed
        as vLLM-Omni's speech server changes the talker's; a request the adapter refuses is a 400 with its reason."""
        from vllm_omni.entrypoints.openai.protocol.audio import OpenAICreateSpeechRequest

        fields = {k: v for k, v in (request.speech or {}).items() if v is not None}
        speech = OpenAICreateSpeechRequest(input=request.reply or "", voice=request.voice, **fields)
        inline_reference = speech.ref_audio is not None  # captured before validate(), as the server does
        error = self.adapter.validate(speech)
        if error:
            raise InvalidStageInput(error, _field_named(error))
        try:
            prepared = await self.adapter.build(speech, [params], inline_reference)
        except ValueError as err:  # a reference audio that does not decode
            raise InvalidStageInput(f"ref_audio: {err}", "ref_audio") from None
        prompt = prepared.prompt
        # Base's codec budget; the call's seed (the request's) also seeds the code predictor (tts_local_seed).
        (adjusted,) = self.adapter.apply_sampling_overrides([params], speech, prompt)
        for name in ("max_tokens", "min_tokens", "extra_args"):
            setattr(params, name, getattr(adjusted, name))
        return prompt


def _field_named(error: str) -> str | None:
    """The request field an adapter's refusal names, for the 400's ``param``: one it quotes ('instructions'),
    else one it mentions (Invalid voice 'x')."""
    names = ("voice", "language", *FIELDS, "speaker_embedding", "input")
    lowered = error.lower()
    quoted = [name for name in names if f"'{name}'" in lowered or f"{name}=" in lowered]
    mentioned = [name for name in names if f" {name} " in f" {lowered} "]
    return next(iter(quoted + mentioned), None)


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
    speech_prompt=SpeechPrompts,
)
