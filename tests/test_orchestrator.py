"""The DAG walk with in-process fake stages (no Ray): routing, ordering, failures, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from omni_serve.api.failure_status import from_failure
from omni_serve.exceptions import AbortedStageCall, StageFailed, StageTimeout
from omni_serve.graph.config import GraphConfig
from omni_serve.graph.orchestrator import Orchestrator
from omni_serve.graph.request import OmniRequest
from omni_serve.graph.transport import Handoff, StageTransport
from omni_serve.payload import HandoffPayload
from omni_serve.types import ChatMessage, FinishReason, Modality, SamplingParams, StageOutput, StageRequest
from tests.fake_stages import GRAPH, FakeStages, request


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


def test_consumer_leaving_cancels_every_stage_call_in_flight() -> None:
    """The talker is mid-stream (after its first chunk) and code2wav calls are running: leaving
    cancels all of them; the thinker had finished and is left alone."""
    stages = FakeStages(chunks=4, hang="code2wav", hang_after_first="talker")

    async def leave_early() -> list[str]:
        stream = Orchestrator(GRAPH, stages).run(request(Modality.TEXT, Modality.AUDIO))
        async for out in stream:
            if out.stage == "thinker" and out.finished:
                break
        while not stages.calls["code2wav"]:  # noqa: ASYNC110 - poll until the first chunk reached code2wav
            await asyncio.sleep(0.01)
        await asyncio.wait_for(stream.aclose(), 30)  # a hang guard: closing must not wait on the stages
        return list(stages.cancelled)  # before asyncio.run() cancels whatever is left itself

    cancelled = asyncio.run(leave_early())
    assert sorted(cancelled) == ["code2wav"] * len(stages.calls["code2wav"]) + ["talker"]
    assert "thinker" not in stages.cancelled


def test_every_stage_call_gets_its_own_engine_id() -> None:
    stages = FakeStages(chunks=3)
    req = request(Modality.TEXT, Modality.AUDIO)
    req.client_request_id = "same-label"
    asyncio.run(collect(Orchestrator(GRAPH, stages), req))
    other = request(Modality.TEXT, Modality.AUDIO)
    other.request_id = "r2"  # the ingress mints a fresh id per request (a uuid)
    asyncio.run(collect(Orchestrator(GRAPH, stages), other))
    calls = [r for rs in stages.calls.values() for r in rs]
    assert len({r.request_id for r in calls}) == len(calls) == 2 * (1 + 1 + 3)
    assert all("same-label" not in r.request_id for r in calls)
    assert {r.client_request_id for r in calls} == {"same-label", None}


def test_an_aborted_stage_call_fails_the_request_instead_of_finishing_it() -> None:
    stages = FakeStages(chunks=2, abort="talker")
    with pytest.raises(StageFailed) as info:
        asyncio.run(collect(Orchestrator(GRAPH, stages), request(Modality.TEXT, Modality.AUDIO)))
    assert info.value.stage == "talker" and isinstance(info.value.cause, AbortedStageCall)
    assert from_failure(info.value, "r").status == 503


def test_audio_only_still_relays_the_text_stage() -> None:
    """The ingress needs the text stage's transcript, usage and finish reason for an audio-only reply."""
    outputs = asyncio.run(collect(Orchestrator(GRAPH, FakeStages()), request(Modality.AUDIO)))
    assert "".join(o.text for o in outputs if o.stage == "thinker") == "hello world"
    assert [o.finish_reason for o in outputs if o.stage == "thinker" and o.finished] == [FinishReason.STOP]


def test_request_deadline_ends_the_walk_with_a_timeout() -> None:
    stages = FakeStages(hang="talker")
    req = request(Modality.TEXT, Modality.AUDIO)
    req.deadline = time.monotonic() + 0.2  # far below stage_timeout_s: the deadline binds
    with pytest.raises(StageTimeout, match="time limit") as info:
        asyncio.run(collect(Orchestrator(GRAPH, stages, stage_timeout_s=60), req))
    assert info.value.stage == "talker" and "talker" in stages.cancelled
    assert from_failure(info.value, "r").status == 504


# --- fan-in: a stage that reads several upstream stages ----------------------------------------

FAN_IN = GraphConfig.model_validate(
    {
        "served_model_name": "fake",
        "stages": [
            {"name": "thinker", "engine": "transformers", "final_output": "text"},
            {"name": "left", "engine": "transformers", "inputs": ["thinker"]},
            {"name": "right", "engine": "transformers", "inputs": ["thinker"]},
            {"name": "mix", "engine": "transformers", "inputs": ["left", "right"], "final_output": "audio"},
        ],
    }
)


class FanInStages(StageTransport):
    """thinker -> (left, right) -> mix: each branch hands on after a delay (``delays``), mix reads both."""

    def __init__(self, delays: dict[str, float], fail: str | None = None, no_handoff: str | None = None):
        self.calls: dict[str, list[StageRequest]] = defaultdict(list)
        self.delays, self.fail, self.no_handoff = delays, fail, no_handoff
        self.cancelled: list[str] = []

    async def voices(self, stage: str) -> list[str]:
        return []

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncIterator[StageOutput]:
        self.calls[stage].append(request)
        try:
            await asyncio.sleep(self.delays.get(stage, 0))
            if stage == self.fail:
                raise RuntimeError("engine exploded")
            if stage == "mix":
                # Every upstream's final handoff, in the order of the stage's inputs.
                assert request.handoff is None
                kinds = [h.kind for h in request.handoffs]
                yield StageOutput(
                    stage=stage, audio=np.full(2, len(kinds), np.float32), finished=True, text=",".join(kinds)
                )
                return
            if stage == "thinker":
                yield StageOutput(stage=stage, text="hi")
            payload = None if stage == self.no_handoff else HandoffPayload(f"fake.{stage}", {"x": np.ones(2)})
            yield StageOutput(stage=stage, finished=True, finish_reason=FinishReason.STOP, handoff=payload)
        except asyncio.CancelledError:
            self.cancelled.append(stage)
            raise


def fan_in_request() -> OmniRequest:
    return OmniRequest(
        request_id="r1",
        modalities={Modality.TEXT, Modality.AUDIO},
        sampling={s.name: SamplingParams() for s in FAN_IN.stages},
        messages=[ChatMessage(role="user", content="hi")],
    )


@pytest.fixture
def claims(monkeypatch: Any) -> list[Handoff]:
    """Every handoff claim the walk makes (each must be released by the time the walk ends)."""
    made: list[Handoff] = []
    claim = Handoff.claim

    def recorded(handoff: Handoff) -> Handoff:
        made.append(held := claim(handoff))
        return held

    monkeypatch.setattr(Handoff, "claim", recorded)
    return made


@pytest.mark.parametrize("slower", ["left", "right"])
def test_fan_in_stage_runs_once_with_every_upstream_handoff_in_input_order(slower: str, claims: list[Handoff]) -> None:
    """Whichever branch finishes last starts the fan-in stage, once, with both handoffs in ``inputs`` order."""
    stages = FanInStages({slower: 0.05})
    outputs = asyncio.run(collect(Orchestrator(FAN_IN, stages), fan_in_request()))
    (mix,) = stages.calls["mix"]
    assert [o.text for o in outputs if o.stage == "mix"] == ["fake.left,fake.right"]
    assert mix.request_id.startswith(f"r1/thinker/{slower}.0/mix")  # started by the branch that finished last
    assert [o.audio[0] for o in outputs if o.audio is not None] == [2.0]
    assert all(c.wants_handoff for c in stages.calls["left"] + stages.calls["right"])
    assert claims and all(held.value is None for held in claims), "a handoff outlived its walk"


def test_fan_in_fails_with_a_failed_branch_and_cancels_the_other() -> None:
    stages = FanInStages({"right": 3600}, fail="left")
    with pytest.raises(StageFailed, match="stage 'left' failed"):
        asyncio.run(collect(Orchestrator(FAN_IN, stages), fan_in_request()))
    assert "mix" not in stages.calls and "right" in stages.cancelled


def test_a_fan_in_stage_that_never_started_lets_go_of_the_handoff_it_was_given(claims: list[Handoff]) -> None:
    """left finishes (its handoff waits for mix), then right fails: when the walk ends, every handoff it
    claimed is released, the one waiting for mix too (it would keep left's payload in the object store)."""
    stages = FanInStages({"right": 0.05}, fail="right")
    with pytest.raises(StageFailed, match="stage 'right' failed"):
        asyncio.run(collect(Orchestrator(FAN_IN, stages), fan_in_request()))
    assert "mix" not in stages.calls and stages.calls["left"]
    assert claims and all(held.value is None for held in claims), "a handoff outlived its walk"


def test_fan_in_fails_when_a_branch_finishes_without_a_handoff() -> None:
    stages = FanInStages({}, no_handoff="right")
    with pytest.raises(StageFailed) as failure:
        asyncio.run(collect(Orchestrator(FAN_IN, stages), fan_in_request()))
    assert failure.value.stage == "right" and "no final handoff for mix" in str(failure.value.cause)
    assert "mix" not in stages.calls


AUDIO_CHUNK = 48000  # float32 samples per code2wav output: 192 KB, the size of a 25-frame chunk


class ManyChunks(FakeStages):
    """A talker that speaks ``chunks`` codec chunks; code2wav decodes each at once into 192 KB of audio."""

    def __init__(self, chunks: int):
        super().__init__(chunks=chunks)
        self.talker_outputs = 0

    async def _attempt(self, stage: str, request: StageRequest) -> AsyncIterator[StageOutput]:
        if stage == "code2wav":
            self.calls[stage].append(request)
            index = int(request.handoff.tensors["codes"][0, 0])
            audio = np.full(AUDIO_CHUNK, index, np.float32)
            yield StageOutput(stage=stage, audio=audio, sample_rate=24000, finished=True)
            return
        async for output in super()._attempt(stage, request):
            self.talker_outputs += stage == "talker"
            yield output


def test_a_client_that_stops_reading_holds_back_code2wav_and_the_talker_then_gets_everything() -> None:
    """The code2wav end of a slow reader: the walk holds at most its byte budget plus one output per queue
    (the root's relay, the talker's queue and relay, one queue per code2wav call: 3 + max_fanout), code2wav
    gets no call its client cannot take, the talker is not read further; reading again delivers it all."""
    stages, budget, fanout = ManyChunks(chunks=300), 1 << 20, 4
    orchestrator = Orchestrator(GRAPH, stages, max_fanout=fanout, buffer_bytes=budget)

    async def go() -> tuple[int, int, int, int, list[int]]:
        audio: list[int] = []
        async with contextlib.aclosing(orchestrator.run(request(Modality.TEXT, Modality.AUDIO))) as outputs:
            async for output in outputs:
                if output.audio is not None:
                    audio.append(int(output.audio[0]))
                if len(audio) == 2:
                    break
            await asyncio.sleep(1.0)  # the client reads nothing: everything upstream runs as far as it may
            made, talked = len(stages.calls["code2wav"]), stages.talker_outputs
            held = (made - len(audio)) * AUDIO_CHUNK * 4  # audio bytes made that the client has not taken
            async for output in outputs:  # the client reads again: the rest of the reply, in order
                if output.audio is not None:
                    audio.append(int(output.audio[0]))
        return made, talked, held, len(audio), audio

    made, talked, held, _, audio = asyncio.run(go())
    queues = 3 + fanout
    assert held <= budget + queues * (AUDIO_CHUNK * 4 + 512), f"{held} bytes of audio held for the client"
    assert made <= 2 + budget // (AUDIO_CHUNK * 4) + queues, f"{made} code2wav calls for a client that read 2"
    assert talked <= made + fanout + 2 * 16, f"the talker was read for {talked} chunks"  # + the talker's queues
    assert audio == list(range(300)), "the reply is not whole and in order after the client read again"
