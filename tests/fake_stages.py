"""The three-stage fake graph and its fake stages: orchestrator tests without Ray."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator

import numpy as np

from omni_serve.graph.config import GraphConfig
from omni_serve.graph.request import OmniRequest
from omni_serve.graph.transport import StageTransport
from omni_serve.models.qwen3_omni import SAMPLE_RATE
from omni_serve.payload import HandoffPayload
from omni_serve.types import ChatMessage, FinishReason, Modality, SamplingParams, StageOutput, StageRequest

GRAPH = GraphConfig.model_validate(
    {
        "served_model_name": "fake",
        "stages": [
            {"name": "thinker", "engine": "transformers", "final_output": "text"},
            {"name": "talker", "engine": "transformers", "inputs": ["thinker"]},
            {"name": "code2wav", "engine": "transformers", "inputs": ["talker"], "final_output": "audio"},
        ],
    }
)


class FakeStages(StageTransport):
    """Stage callers that record every call; code2wav finishes chunks in reverse order on purpose."""

    async def voices(self, stage: str) -> list[str]:
        return []

    def __init__(
        self,
        chunks: int = 4,
        fail: str | None = None,
        hang: str | None = None,
        abort: str | None = None,
        hang_after_first: str | None = None,
        length: str | None = None,
    ):
        self.calls: dict[str, list[StageRequest]] = defaultdict(list)
        self.chunks, self.fail, self.hang, self.abort = chunks, fail, hang, abort
        self.length = length  # this stage's calls stop at their max_tokens (finish_reason LENGTH)
        self.hang_after_first = hang_after_first
        self.cancelled: list[str] = []

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncIterator[StageOutput]:
        self.calls[stage].append(request)
        try:
            if stage == self.fail:
                raise RuntimeError("engine exploded")
            if stage == self.hang:
                await asyncio.sleep(3600)
            if stage == "thinker":
                for word in ["hello ", "world"]:
                    yield StageOutput(stage=stage, text=word)
                payload = HandoffPayload("fake.thinker2talker", {"hidden": np.ones((3, 4), np.float32)})
                reason = FinishReason.LENGTH if stage == self.length else FinishReason.STOP
                yield StageOutput(stage=stage, finished=True, finish_reason=reason, handoff=payload)
            elif stage == "talker":
                assert request.handoff.kind == "fake.thinker2talker"
                for i in range(self.chunks):
                    payload = HandoffPayload("fake.codes", {"codes": np.full((2, 3), i)})
                    last = i == self.chunks - 1
                    reason = FinishReason.ABORT if last and stage == self.abort else FinishReason.STOP
                    reason = FinishReason.LENGTH if stage == self.length else reason
                    yield StageOutput(
                        stage=stage, handoff=payload, finished=last, finish_reason=reason if last else None
                    )
                    if stage == self.hang_after_first:
                        await asyncio.sleep(3600)
            else:
                index = int(request.handoff.tensors["codes"][0, 0])
                await asyncio.sleep(0.01 * (self.chunks - index))  # later chunks finish first
                yield StageOutput(
                    stage=stage, audio=np.full(5, index, np.float32), sample_rate=SAMPLE_RATE, finished=True
                )
        except asyncio.CancelledError:
            self.cancelled.append(stage)
            raise


def request(*modalities: Modality) -> OmniRequest:
    return OmniRequest(
        request_id="r1",
        modalities=set(modalities),
        sampling={s.name: SamplingParams() for s in GRAPH.stages},
        messages=[ChatMessage(role="user", content="hi")],
    )
