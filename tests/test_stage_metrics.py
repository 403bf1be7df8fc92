"""vLLM-Omni's ``return_stage_metrics`` on a chat reply: the stage log the orchestrator records, and the
``metrics`` object the reply builds from it (in process, no Ray).

vLLM-Omni 0.30 (``serving_chat.py``, ``OmniBase._process_single_result``): every streamed chunk of a
final-output stage carries ``metrics`` (``{}`` until a stage finished, then ``stage_metrics`` keyed by
stage id for every stage finished so far, plus the chunk's own stage's id, output type and token counts
at the top level once that stage finished); the include_usage chunk and the JSON response the last one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from omni_serve.api.openai.chat import ChatCompletionRequest, ChatReply
from omni_serve.graph.orchestrator import Orchestrator
from omni_serve.graph.stage_log import StageLog
from omni_serve.types import FinishReason, Modality, StageOutput, Usage
from tests.fake_stages import GRAPH, FakeStages, request

PROMPT = 11


def ticks(step_s: float = 0.01) -> Callable[[], float]:
    """A clock that moves ``step_s`` at each read (the log reads it per output and at a stage's first call)."""
    counter = itertools.count(1)
    return lambda: next(counter) * step_s


async def walk(log: StageLog) -> AsyncIterator[StageOutput]:
    """What the orchestrator does for a text+audio request, two codec chunks: it records every call and
    output (the talker's too) and relays the final outputs. Clock reads, 10 ms apart, in the comments."""

    def text(s: str, so_far: int, **final: Any) -> StageOutput:
        return StageOutput("thinker", text=s, token_ids=[1] * len(s), usage=Usage(PROMPT, so_far), **final)

    def audio() -> StageOutput:
        return StageOutput(
            "code2wav", audio=np.zeros(240, np.float32), sample_rate=24000, finished=True,
            finish_reason=FinishReason.STOP, usage=Usage(prompt_tokens=1),
        )  # fmt: skip

    log.started("thinker")  # 10 ms
    for output in (text("Hel", 1), text("lo", 3), text("!", 4, finished=True, finish_reason=FinishReason.STOP)):
        log.saw("thinker", output)  # 20, 30, 40 ms
        yield output
    log.started("talker")  # 50
    log.saw("talker", StageOutput("talker", handoff="chunk 0"))  # 60
    log.started("code2wav")  # 70
    log.saw("code2wav", first := audio())  # 80
    yield first
    last_chunk = StageOutput(
        "talker", handoff="chunk 1", finished=True, finish_reason=FinishReason.STOP, usage=Usage(20, 2)
    )
    log.saw("talker", last_chunk)  # 90
    log.started("code2wav")  # a later call: only the first call's start is kept
    log.saw("code2wav", second := audio())  # 100
    yield second


THINKER = {
    "stage_id": 0, "stage_name": "thinker", "final_output_type": "text",
    "stage_gen_time_ms": 30.0,  # its call's start (10 ms) to its last output (40 ms)
    "finish_reason": "stop", "num_tokens_in": PROMPT, "num_tokens_out": 4,
    "output_unit_type": "text", "output_unit_count": 4,
    "serving_time_to_first_output_ms": 20.0,  # from the request's arrival (0)
    "time_per_output_unit_ms": 6.667,  # (40 - 20 ms) over the 3 tokens after the first
    "inter_output_latencies_ms": [10.0, 10.0], "inter_output_latency_ms": 10.0,
}  # fmt: skip
TALKER = {
    "stage_id": 1, "stage_name": "talker", "final_output_type": None,
    "stage_gen_time_ms": 40.0, "finish_reason": "stop", "num_tokens_in": 20, "num_tokens_out": 2,
    "output_unit_type": "stream", "output_unit_count": 2,  # its codec frames
    "serving_time_to_first_output_ms": 60.0, "time_per_output_unit_ms": 30.0,
    "inter_output_latencies_ms": [30.0], "inter_output_latency_ms": 30.0,
}  # fmt: skip
CODE2WAV = {
    "stage_id": 2, "stage_name": "code2wav", "final_output_type": "audio",
    "stage_gen_time_ms": 30.0,  # the first call's start (70 ms) to the last output (100 ms)
    "finish_reason": "stop", "num_tokens_in": 2, "num_tokens_out": 0,  # summed over its two calls
    "output_unit_type": "audio", "output_unit_count": 480,
    "serving_time_to_first_output_ms": 80.0,
    "inter_output_latencies_ms": [20.0], "inter_output_latency_ms": 20.0,
    "audio_frames": 480, "audio_sample_rate": 24000, "audio_duration_s": 0.02,
}  # fmt: skip


def reply(log: StageLog | None) -> ChatReply:
    return ChatReply(
        "r1", "tiny", {Modality.TEXT, Modality.AUDIO}, "wav", "thinker", include_usage=True, stage_log=log,
        stage_metrics=log is not None,
    )  # fmt: skip


def streamed(log: StageLog | None) -> list[dict[str, Any]]:
    async def collect() -> list[str]:
        return [event async for event in reply(log).stream(walk(log or StageLog(GRAPH)))]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_every_chunk_carries_the_stages_finished_so_far() -> None:
    chunks = streamed(StageLog(GRAPH, start=0.0, clock=ticks()))
    role, hel, lo, bang, audio1, audio2, finish, usage = chunks
    assert "metrics" not in role  # as vLLM-Omni: the role chunk has none
    assert hel["metrics"] == lo["metrics"] == {}  # no stage finished yet
    # The thinker's last delta: it finished, so its entry and, at the top level, its id and counts.
    assert bang["metrics"] == {
        "stage_metrics": {"0": THINKER},
        "stage_id": 0, "final_output_type": "text", "num_tokens_in": PROMPT, "num_tokens_out": 4,
    }  # fmt: skip
    # code2wav's first call finished, but the talker may still start more: neither is done yet.
    assert audio1["metrics"] == {"stage_metrics": {"0": THINKER}}
    everything = {
        "stage_metrics": {"0": THINKER, "1": TALKER, "2": CODE2WAV},
        "stage_id": 2, "final_output_type": "audio", "num_tokens_in": 2, "num_tokens_out": 0,
    }  # fmt: skip
    assert audio2["metrics"] == finish["metrics"] == usage["metrics"] == everything
    assert finish["choices"][0]["finish_reason"] == "stop" and usage["choices"] == []


def test_the_json_reply_carries_the_last_metrics() -> None:
    log = StageLog(GRAPH, start=0.0, clock=ticks())
    body = asyncio.run(reply(log).json(walk(log)))
    assert body["metrics"]["stage_metrics"] == {"0": THINKER, "1": TALKER, "2": CODE2WAV}
    assert body["usage"] == {"prompt_tokens": PROMPT, "completion_tokens": 4, "total_tokens": PROMPT + 4}


def test_no_metrics_unless_asked() -> None:
    assert not any("metrics" in chunk for chunk in streamed(None))
    log = StageLog(GRAPH)
    assert "metrics" not in asyncio.run(reply(None).json(walk(log)))


@pytest.mark.parametrize("sent, asked", [(True, True), (False, False), (None, False)])
def test_the_request_field(sent: Any, asked: bool) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "return_stage_metrics": sent}
    assert bool(ChatCompletionRequest.model_validate(body).return_stage_metrics) is asked


def test_the_request_field_is_a_strict_boolean() -> None:
    """A string is refused, not coerced (#51: booleans strict, as OpenAI's are)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "return_stage_metrics": "true"}
    with pytest.raises(ValidationError, match="return_stage_metrics"):
        ChatCompletionRequest.model_validate(body)


def test_the_orchestrator_records_every_stage_call_and_output() -> None:
    """Intermediate stages included: the talker's chunks never reach the reply, its calls and outputs do the log."""
    stages = FakeStages(chunks=4)
    omni = request(Modality.TEXT, Modality.AUDIO)
    omni.stage_log = log = StageLog(GRAPH)
    done_when_relayed = []

    async def run() -> None:
        async for output in Orchestrator(GRAPH, stages).run(omni):
            done_when_relayed.append((output.stage, [r.name for r in log.done_stages()]))

    asyncio.run(run())
    records = log.stages
    assert [(r.calls, r.finished_calls) for r in records.values()] == [(1, 1), (1, 1), (4, 4)]
    assert [len(r.output_times) for r in records.values()] == [3, 4, 4]
    assert records["code2wav"].audio_samples == 4 * 5 and records["code2wav"].sample_rate == 24000
    assert all(r.first_call_at <= r.first_output_at <= r.output_times[-1] for r in records.values())
    assert records["thinker"].first_output_at == records["thinker"].output_times[0]
    assert records["talker"].first_output_at == records["talker"].output_times[0]  # a handoff is content
    # The log runs ahead of the reply (outputs arrive before the ones queued ahead of them are relayed):
    # what a chunk reports is what the ingress knew when it sent it. By the last output, every stage is done.
    assert done_when_relayed[-1] == ("code2wav", ["thinker", "talker", "code2wav"])


def test_a_text_only_request_reports_only_the_stage_that_ran() -> None:
    omni = request(Modality.TEXT)
    omni.stage_log = log = StageLog(GRAPH)

    async def run() -> None:
        async for _ in Orchestrator(GRAPH, FakeStages()).run(omni):
            pass

    asyncio.run(run())
    assert [r.name for r in log.done_stages()] == ["thinker"]
    assert log.stages["talker"].calls == log.stages["code2wav"].calls == 0
