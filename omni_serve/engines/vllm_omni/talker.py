"""The talker role of a vLLM-Omni stage: the thinker's handoff -> codec frames for code2wav.

Frames go downstream whole at the end, or, with ``codec_chunk``, in chunks as vLLM-Omni's
async-chunk connector cuts them (each chunk its own code2wav call).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from omni_serve.engines.vllm_omni.engine import VllmOmniEngine
from omni_serve.engines.vllm_omni.mapping import CodecRows, finish_reason, lookup, multimodal_output
from omni_serve.models import vllm_omni_handoffs as handoffs
from omni_serve.payload import HandoffPayload
from omni_serve.types import EngineError, InvalidStageInput, StageOutput, StageRequest, Usage


class TalkerEngine(VllmOmniEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self._speakers: dict[str, int] = {}  # lower-case speaker name -> speaker id, from the checkpoint

    async def _setup(self, hf_config: Any) -> None:
        talker_config = getattr(hf_config, "talker_config", None)
        self._speakers = {k.lower(): int(v) for k, v in (getattr(talker_config, "speaker_id", None) or {}).items()}

    def voices(self) -> list[str]:
        """The speaker names (lower case, as vLLM-Omni matches them)."""
        return sorted(self._speakers)

    def _voice(self, voice: str | None) -> str | None:
        if voice is None:
            return None
        if voice.lower() not in self._speakers:
            raise InvalidStageInput(f"voice: unknown voice {voice!r}; valid voices: {sorted(self._speakers)}")
        return voice.lower()

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        handoff = self._handoff_in(handoff)
        pipeline = self.args.pipeline
        voice = self._voice(request.voice)
        prompt = handoffs.talker_prompt(pipeline, handoff, request_id=request.request_id, voice=voice)
        if not prompt["prompt_token_ids"]:  # the EngineCore would die on it (assert num_new_tokens > 0)
            raise EngineError(f"stage {self.stage_name}: the thinker's handoff has no assistant turn to speak")
        # DELTA: vLLM-Omni keeps the codec frames as a list of per-step tensors until the end.
        # A frame's residual code groups come with the next step, so the last sampled token never
        # gets a frame: one more step yields max_tokens whole frames (as in the transformers family).
        params = self._params(request, "DELTA", max_tokens=request.sampling.max_tokens + 1)
        # Not reproducible per seed: vLLM-Omni 0.30's Qwen3-Omni code predictor samples the residual
        # code groups from the worker's global RNG (its talker_mtp ignores the per-request generator the
        # runner builds from extra_args["tts_local_seed"], which only Qwen3-TTS uses). No upstream issue found.
        chunker = None
        if self.args.codec_chunk is not None:
            chunker = handoffs.AsyncChunkTransfer(
                pipeline,
                request.request_id,
                chunk_frames=self.args.codec_chunk.chunk_frames,
                left_context_frames=self.args.codec_chunk.left_context_frames,
                initial_chunk_frames=self.args.codec_chunk.initial_chunk_frames,
                stop_token_ids=list(params.stop_token_ids or ()),
            )
        rows = CodecRows()
        frames: list[Any] = []
        token_ids: list[int] = []
        async for output in self._request(request, prompt, params):
            completion = output.outputs[0]
            token_ids.extend(completion.token_ids)
            fresh = rows.new(lookup(multimodal_output(output), "codes.audio"))
            if fresh is not None:
                if chunker is None:
                    frames.append(fresh)
                else:
                    for row in range(len(fresh)):
                        payload = chunker.push(fresh[row : row + 1], finished=False)
                        if payload is not None:
                            yield StageOutput(stage=self.stage_name, handoff=payload)
            if not output.finished:
                continue
            import torch

            if chunker is not None:
                final = chunker.push(torch.zeros((0, 0), dtype=torch.long), finished=True)
            else:
                final = handoffs.talker_handoff(
                    pipeline,
                    request_id=request.request_id,
                    output_token_ids=token_ids,
                    codes=torch.cat(frames) if frames else None,
                )
            yield StageOutput(
                stage=self.stage_name,
                handoff=final,
                finished=True,
                finish_reason=finish_reason(completion.finish_reason),
                usage=Usage(prompt_tokens=len(prompt["prompt_token_ids"]), completion_tokens=len(token_ids)),
            )
