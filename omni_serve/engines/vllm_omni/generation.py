"""``llm_generation`` stages: a prompt -> one generation step (a codec decoder: codec frames -> audio).

A downstream stage's prompt is built from its upstream's handoff by its declared input processor, the
payload applied as vLLM-Omni's scheduler applies it to a generation stage (the codec ids become the
prompt; a chunk's left context seeds the model's buffer: :func:`omni_serve.models.vllm_omni.edges.
apply_payload`). One FINAL_ONLY engine request a call; its output is audio when the stage's declared
final output is audio, else a handoff for the next stage.

**Left context.** vLLM-Omni's codec decoders honour a chunk's left context only in their async-chunk mode,
where they wait for chunks from their own connector; here a chunk arrives whole, so the decoder decodes
the context frames too and the replica cuts their samples. That needs the model's frame geometry (a
per-model hook: :class:`omni_serve.models.vllm_omni.hooks.FrameGeometry`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from omni_serve.engines.vllm_omni.engine import VllmOmniEngine
from omni_serve.engines.vllm_omni.mapping import audio_samples, finish_reason, multimodal_output
from omni_serve.engines.vllm_omni.prompts import EntryPrompts
from omni_serve.exceptions import EngineError
from omni_serve.models import codec
from omni_serve.models.vllm_omni.hooks import FrameGeometry
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, SamplingParams, StageOutput, StageRequest, Usage


class GenerationEngine(VllmOmniEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.prompts = EntryPrompts(stage_name, self.args.pipeline, self.pipeline_hooks, False, self.declared)
        self.emits_audio = bool(self.declared.final_output and self.declared.final_output_type == "audio")
        self._geometry: FrameGeometry | None = None
        self._decode_lag = 0  # samples a lone decode holds back at its end (measured in _setup())

    def check_declaration(self) -> None:
        super().check_declaration()
        if self.stream_input:
            raise EngineError(f"stage {self.stage_name}: stream_input: a generation stage decodes one input a call")
        if self.is_entry and (self.args.entry != "speech" or self.pipeline_hooks.speech_prompt is None):
            raise EngineError(
                f"stage {self.stage_name}: an llm_generation entry stage takes text to speak (engine_args.entry "
                f"speech) in a prompt of its model's own, and omni_serve has none for {self.args.pipeline!r} yet"
            )

    async def _setup(self, hf_config: Any) -> None:
        if self.is_entry:
            self.prompts.start(self._vllm_config, self._tokenizer, self.collective_rpc)
        if self.hooks.frame_geometry is not None:
            self._geometry = self.hooks.frame_geometry(hf_config)
        if self.hooks.measure_decode_lag and self._geometry is not None:
            self._decode_lag = await self._measure_decode_lag(self._geometry)

    def stats(self) -> dict[str, Any]:
        """The engine's stats, and the vocoder lag it measured (samples a decode holds back)."""
        return {**super().stats(), "vocoder_lag": self._decode_lag}

    async def _measure_decode_lag(self, geometry: FrameGeometry) -> int:
        """Decode one frame alone: the samples it lacks of a whole frame are the decoder's lag.

        vLLM-Omni batches generation requests zero-padded to the longest, and a shorter request then gets
        its held-back tail computed from the padding: cutting every decode to ``frames * samples_per_frame
        - lag`` keeps a request's audio independent of its batch. (vLLM-Omni's
        ``Qwen3OmniMoeForConditionalGeneration.forward``, code2wav branch; no upstream issue found: its own
        streaming path trims by left context and never returns that tail.)
        """
        request = StageRequest(request_id="vocoder-lag", sampling=SamplingParams(temperature=0.0))
        prompt = {"prompt_token_ids": [1] * geometry.code_groups}
        async for output in self._request(request, prompt, self._params(request, "FINAL_ONLY")):
            if output.finished:
                audio, _ = audio_samples(multimodal_output(output))
                return max(geometry.samples_per_frame - len(audio), 0)
        raise EngineError(f"stage {self.stage_name}: the warm-up decode returned no audio")

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        params = self._params(request, "FINAL_ONLY")
        if self.is_entry:
            prompt = await self.prompts.speech(request, params)
        else:
            prompt = self._consumer_prompt(request, handoff, generation=True)
        ids = prompt["prompt_token_ids"]
        if not ids:
            raise EngineError(f"stage {self.stage_name}: its upstream's handoff has nothing to decode")
        meta = (prompt.get("additional_information") or {}).get("meta", {})
        left = 0 if self.hooks.decoder_cuts_left_context else int(meta.get("left_context_size", 0))
        async for output in self._request(request, prompt, params):
            if not output.finished:
                continue
            usage = Usage(prompt_tokens=len(ids))
            if not self.emits_audio:  # a generation stage with a downstream stage of its own
                mm = multimodal_output(output)
                yield StageOutput(
                    stage=self.stage_name,
                    handoff=self.producer().whole(request.request_id, ids, [], mm) if request.wants_handoff else None,
                    finished=True,
                    finish_reason=finish_reason(output.outputs[0].finish_reason),
                    usage=usage,
                )
                continue
            audio, rate = audio_samples(multimodal_output(output))
            yield StageOutput(
                stage=self.stage_name,
                audio=self._trimmed(audio, len(ids), left),
                sample_rate=rate,
                finished=True,
                finish_reason=FinishReason.STOP,
                usage=usage,
            )

    def _trimmed(self, audio: Any, num_ids: int, left: int) -> Any:
        """A decode's audio: cut to whole frames less the lag (see :meth:`_measure_decode_lag`), and the left
        context's samples cut (the module docstring)."""
        if self._geometry is None:
            if left > 0:
                raise EngineError(
                    f"stage {self.stage_name}: a chunk with left context, and no frame geometry known for "
                    f"pipeline {self.args.pipeline!r} (omni_serve.models.vllm_omni hooks: frame_geometry)"
                )
            return audio
        spf = self._geometry.samples_per_frame
        frames = num_ids // self._geometry.code_groups
        audio = audio[: frames * spf - self._decode_lag]
        return codec.trim_left_context(audio, frames, left, spf)
