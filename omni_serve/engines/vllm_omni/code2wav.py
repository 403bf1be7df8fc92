"""The code2wav role of a vLLM-Omni stage: codec frames -> 24 kHz mono audio, one decode per call."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from omni_serve.engines.vllm_omni.engine import VllmOmniEngine
from omni_serve.engines.vllm_omni.mapping import audio_samples, multimodal_output
from omni_serve.models import qwen3_omni
from omni_serve.models import vllm_omni_handoffs as handoffs
from omni_serve.payload import HandoffPayload
from omni_serve.types import EngineError, FinishReason, SamplingParams, StageOutput, StageRequest, Usage


class Code2WavEngine(VllmOmniEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self._code_groups = 16  # Qwen3-Omni's; _setup() reads the checkpoint's
        self._samples_per_frame = 1920
        self._vocoder_lag = 0  # samples a lone decode holds back at its end (measured in _setup())

    async def _setup(self, hf_config: Any) -> None:
        code2wav_config = getattr(hf_config, "code2wav_config", None)
        if code2wav_config is not None:
            self._code_groups = int(code2wav_config.num_quantizers)
            self._samples_per_frame = math.prod(code2wav_config.upsample_rates) * math.prod(
                code2wav_config.upsampling_ratios
            )
        if self.args.pipeline == "qwen3_omni_moe":
            self._vocoder_lag = await self._measure_vocoder_lag()

    def stats(self) -> dict[str, Any]:
        """The engine's stats, and the vocoder lag it measured (samples a decode holds back)."""
        return {**super().stats(), "vocoder_lag": self._vocoder_lag}

    async def _measure_vocoder_lag(self) -> int:
        """Decode one frame alone: the samples it lacks of a whole frame are the vocoder's lag.

        vLLM-Omni batches code2wav requests zero-padded to the longest, and a shorter request then
        gets its held-back tail computed from the padding: cutting every decode to
        ``frames * samples_per_frame - lag`` keeps a request's audio independent of its batch.
        (vLLM-Omni's ``Qwen3OmniMoeForConditionalGeneration.forward``, code2wav branch; no upstream
        issue found: its own streaming path trims by left context and never returns that tail.)
        """
        request = StageRequest(request_id="vocoder-lag", sampling=SamplingParams(temperature=0.0))
        prompt = {"prompt_token_ids": [1] * self._code_groups}
        async for output in self._request(request, prompt, self._params(request, "FINAL_ONLY")):
            if output.finished:
                audio, _ = audio_samples(multimodal_output(output))
                return max(self._samples_per_frame - len(audio), 0)
        raise EngineError(f"stage {self.stage_name}: the warm-up decode returned no audio")

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        handoff = self._handoff_in(handoff)
        prompt = handoffs.code2wav_prompt(self.args.pipeline, handoff)
        left = int((prompt.get("additional_information") or {}).get("meta", {}).get("left_context_size", 0))
        async for output in self._request(request, prompt, self._params(request, "FINAL_ONLY")):
            if not output.finished:
                continue
            audio, rate = audio_samples(multimodal_output(output))
            # vLLM-Omni's code2wav honours a chunk's left context only in its async-chunk mode, where it
            # waits for chunks from its own connector; here a chunk arrives whole, so it decodes the
            # context frames too and the replica cuts their samples, as the transformers family does.
            frames = len(prompt["prompt_token_ids"]) // self._code_groups
            audio = audio[: frames * self._samples_per_frame - self._vocoder_lag]  # see _measure_vocoder_lag
            audio = qwen3_omni.trim_left_context(audio, frames, left, self._samples_per_frame)
            yield StageOutput(
                stage=self.stage_name,
                audio=audio,
                sample_rate=rate,
                finished=True,
                finish_reason=FinishReason.STOP,
                usage=Usage(prompt_tokens=len(prompt["prompt_token_ids"])),
            )
