"""The DAG walk with in-process fake stages (no Ray): routing, ordering, failures, cancellation."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator

import numpy as np
import pytest

from omni_serve.config import GraphConfig
from omni_serve.orchestrator import OmniRequest, Orchestrator, StageFailed, StageTimeout
from omni_serve.types import (
    ChatMessage,
    FinishReason,
    HandoffPayload,
    Modality,
    SamplingParams,
    StageOutput,
    StageRequest,
)

GRAPH = GraphConfig.model_validate(
    {
        "served_model_name": "fake",
        "stages": [
            {"name": "thinker", "engine": "transformers", "final_output": "text"},
            {"name": "talker", "engine": "transformers", "input": "thinker"},
            {"name": "code2wav", "engine": "transformers", "input": "talker", "final_output": "audio"},
        ],
    }
)


class FakeStages:
    """Stage callers that record every call; code2wav finishes chunks in reverse order on purpose."""

    def __init__(self, chunks: int = 4, fail: str | None = None, hang: str | None = None):
        self.calls: dict[str, list[StageRequest]] = defaultdict(list)
        self.chunks, self.fail, self.hang = chunks, fail, hang
        self.cancelled: list[str] = []

    async def __call__(self, stage: str, request: StageRequest) -> AsyncIterator[StageOutput]:
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
                yield StageOutput(stage=stage, finished=True, finish_reason=FinishReason.STOP, handoff=payload)
            elif stage == "talker":
                assert request.handoff.kind == "fake.thinker2talker"
                for i in range(self.chunks):
                    payload = HandoffPayload("fake.codes", {"codes": np.full((2, 3), i)})
                    yield StageOutput(stage=stage, handoff=payload, finished=i == self.chunks - 1)
            else:
                index = int(request.handoff.tensors["codes"][0, 0])
                await asyncio.sleep(0.01 * (self.chunks - index))  # later chunks finish first
                yield StageOutput(stage=stage, audio=np.full(5, index, np.float32), sample_rate=24000, finished=True)
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


async def collect(orchestrator: Orchestrator, req: OmniRequest) -> list[StageOutput]:
    return [out async for out in orchestrator.run(req)]


def test_text_only_runs_only_the_thinker() -> None:
    stages = FakeStages()
    outputs = asyncio.run(collect(Orchestrator(GRAPH, stages), request(Modality.TEXT)))
    assert "".join(o.text for o in outputs) == "hello world"
    assert set(stages.calls) == {"thinker"}
    assert stages.calls["thinker"][0].wants_handoff is False
    assert all(o.handoff is None for o in outputs)  # references are routed, never returned


def test_audio_chunks_relayed_in_handoff_order_despite_out_of_order_completion() -> None:
    stages = FakeStages(chunks=4)
    outputs = asyncio.run(collect(Orchestrator(GRAPH, stages), request(Modality.TEXT, Modality.AUDIO)))
    audio = [int(o.audio[0]) for o in outputs if o.audio is not None]
    assert audio == [0, 1, 2, 3]
    assert len(stages.calls["talker"]) == 1 and len(stages.calls["code2wav"]) == 4
    assert [r.chunk_index for r in stages.calls["code2wav"]] == [0, 1, 2, 3]
    assert stages.calls["thinker"][0].wants_handoff and not stages.calls["code2wav"][0].wants_handoff
    assert "".join(o.text for o in outputs) == "hello world"


def test_failing_stage_surfaces_with_its_name() -> None:
    stages = FakeStages(fail="code2wav")
    with pytest.raises(StageFailed) as info:
        asyncio.run(collect(Orchestrator(GRAPH, stages), request(Modality.TEXT, Modality.AUDIO)))
    assert info.value.stage == "code2wav"


def test_silent_stage_times_out_and_is_cancelled() -> None:
    stages = FakeStages(hang="talker")
    with pytest.raises(StageTimeout):
        asyncio.run(collect(Orchestrator(GRAPH, stages, stage_timeout_s=0.2), request(Modality.TEXT, Modality.AUDIO)))
    assert "talker" in stages.cancelled


def test_consumer_leaving_cancels_every_stage_call() -> None:
    stages = FakeStages(hang="code2wav")

    async def leave_early() -> None:
        stream = Orchestrator(GRAPH, stages).run(request(Modality.TEXT, Modality.AUDIO))
        async for out in stream:
            if out.stage == "thinker" and out.finished:
                break
        while not stages.calls["code2wav"]:  # noqa: ASYNC110 - poll until the first chunk reached code2wav
            await asyncio.sleep(0.01)
        await stream.aclose()

    asyncio.run(leave_early())
    assert "code2wav" in stages.cancelled
