"""The code2wav stage: one codec chunk -> its float32 24 kHz waveform, left context trimmed."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

from omni_serve.engines.transformers.worker import Emit, HFEngine
from omni_serve.exceptions import InvalidStageInput
from omni_serve.models import codec, qwen3_omni
from omni_serve.pacing import StepPacer
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, StageOutput, StageRequest, Usage


class Code2WavEngine(HFEngine):
    """One codec chunk -> its float32 24 kHz waveform, left context trimmed."""

    def _setup(self, model: Any) -> None:
        self.code2wav = model.code2wav

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        if handoff is None or handoff.kind != codec.CODEC_CHUNK:
            raise InvalidStageInput(f"stage {self.stage_name}: code2wav needs a {codec.CODEC_CHUNK} handoff")

        def job(emit: Emit, cancelled: threading.Event) -> None:
            pacer = StepPacer(self.args.min_step_s, cancelled)
            audio = qwen3_omni.decode_codec_chunk(self.code2wav, handoff)
            pacer.step_done()  # code2wav decodes a chunk in one step
            emit(audio)

        async with contextlib.aclosing(self._run(request.request_id, job)) as batches:
            async for batch in batches:
                yield StageOutput(
                    stage=self.stage_name,
                    audio=batch[0],
                    sample_rate=qwen3_omni.SAMPLE_RATE,
                    finished=True,
                    finish_reason=FinishReason.STOP,
                    usage=Usage(prompt_tokens=int(handoff.meta.get("num_frames", 0))),
                )
