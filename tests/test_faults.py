"""Faults: a stage replica dies under load.

Every in-flight request either completes in full or ends with a clear 503 (OpenAI error JSON; in
SSE an in-band error event and no [DONE]); none hangs, none returns a short result as success; the
graph recovers without a restart. Stage calls that fail before yielding anything because their
replica died are retried once on another replica; the unit tests pin down exactly what is retried.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, OwnerDiedError, RayTaskError

from omni_serve.api.failure_status import from_failure
from omni_serve.exceptions import IncompleteStageStream, InvalidStageInput, StageFailed
from omni_serve.graph.orchestrator import Orchestrator
from omni_serve.graph.request import OmniRequest
from omni_serve.graph.transport import StageTransport, replica_gone
from omni_serve.models.qwen3_omni import SAMPLE_RATE
from omni_serve.payload import HandoffPayload
from omni_serve.types import ChatMessage, FinishReason, Modality, SamplingParams, StageOutput
from tests.conftest import wait_until
from tests.fake_stages import GRAPH  # the same three-stage fake graph
from tests.faults import BODY, CLIENT_TIMEOUT_S, SHARED_GRAPH, TWO_PADDED_TALKERS, replica_names, samples

# ---- unit: what is retried, and what a failure maps to (no Ray cluster) ------------------------


def actor_died() -> ActorDiedError:
    return ActorDiedError()


def wrapped(cause: BaseException) -> BaseException:
    """How Ray re-raises an exception raised inside the stage replica."""
    return RayTaskError("generate", "Traceback ...", cause).as_instanceof_cause()


class FlakyStages(StageTransport):
    """Fake stage callers; ``faults[stage]`` is a list of (error, after_n_outputs) per successive call."""

    async def voices(self, stage: str) -> list[str]:
        return []

    def __init__(self, faults: dict[str, list[tuple[BaseException, int] | None]], chunks: int = 3):
        self.faults = faults
        self.chunks = chunks
        self.calls: Counter[str] = Counter()

    async def _attempt(self, stage: str, request: Any) -> AsyncIterator[StageOutput]:
        attempt = self.calls[stage]
        self.calls[stage] += 1
        plan = self.faults.get(stage, [])
        fault = plan[attempt] if attempt < len(plan) else None
        outputs = self._outputs(stage, request)
        for n, output in enumerate(outputs):
            if fault is not None and n == fault[1]:
                raise fault[0]
            yield output
        if fault is not None and fault[1] >= len(outputs):
            raise fault[0]

    def _outputs(self, stage: str, request: Any) -> list[StageOutput]:
        if stage == "thinker":
            payload = HandoffPayload("fake.t2t", {"x": np.zeros(2, np.float32)})
            return [
                StageOutput(stage=stage, text="hi "),
                StageOutput(stage=stage, text="there", finished=True, finish_reason=FinishReason.STOP, handoff=payload),
            ]
        if stage == "talker":
            return [
                StageOutput(
                    stage=stage,
                    handoff=HandoffPayload("fake.codes", {"i": np.array([i])}),
                    finished=i == self.chunks - 1,
                )
                for i in range(self.chunks)
            ]
        index = int(request.handoff.tensors["i"][0])
        return [StageOutput(stage=stage, audio=np.full(4, index, np.float32), sample_rate=SAMPLE_RATE, finished=True)]


def omni_request() -> OmniRequest:
    return OmniRequest(
        request_id="r",
        modalities={Modality.TEXT, Modality.AUDIO},
        sampling={s.name: SamplingParams() for s in GRAPH.stages},
        messages=[ChatMessage(role="user", content="hi")],
    )


def run(stages: FlakyStages) -> list[StageOutput]:
    async def collect() -> list[StageOutput]:
        return [o async for o in Orchestrator(GRAPH, stages).run(omni_request())]

    return asyncio.run(collect())


def audio_of(outputs: list[StageOutput]) -> list[int]:
    return [int(o.audio[0]) for o in outputs if o.audio is not None]


@pytest.mark.parametrize("stage", ["thinker", "talker", "code2wav"])
def test_replica_death_before_any_output_is_retried_once(stage: str) -> None:
    stages = FlakyStages({stage: [(actor_died(), 0)]})
    outputs = run(stages)
    assert audio_of(outputs) == [0, 1, 2]  # the whole reply, nothing lost or duplicated
    assert "".join(o.text for o in outputs) == "hi there"
    assert stages.calls[stage] == (2 if stage != "code2wav" else 4)  # code2wav: 3 chunks + 1 retry


def test_unreachable_replica_is_retried_too() -> None:
    stages = FlakyStages({"talker": [(ActorUnavailableError("gone", b"\0" * 16), 0)]})
    assert audio_of(run(stages)) == [0, 1, 2]
    assert stages.calls["talker"] == 2


def test_second_death_is_not_retried_again() -> None:
    stages = FlakyStages({"talker": [(actor_died(), 0), (actor_died(), 0)]})
    with pytest.raises(StageFailed) as info:
        run(stages)
    assert info.value.stage == "talker" and stages.calls["talker"] == 2
    assert from_failure(info.value, "r").status == 503


def test_death_after_output_fails_the_request_instead_of_truncating_it() -> None:
    stages = FlakyStages({"talker": [(actor_died(), 1)]})
    with pytest.raises(StageFailed) as info:
        run(stages)
    assert info.value.stage == "talker" and stages.calls["talker"] == 1
    error = from_failure(info.value, "r")
    assert error.status == 503 and error.retry_after_s and "talker" in error.message


@pytest.mark.parametrize(
    "error",
    [
        wrapped(InvalidStageInput("prompt too long")),
        wrapped(actor_died()),  # something the stage called died: not this replica
        wrapped(OwnerDiedError("ff" * 28, None, "")),  # its input handoff was lost with the upstream replica
        RuntimeError("engine exploded"),
    ],
    ids=["invalid-input", "inner-actor-death", "lost-handoff", "engine-error"],
)
def test_errors_raised_by_the_stage_are_not_retried(error: BaseException) -> None:
    assert not replica_gone(error)
    stages = FlakyStages({"talker": [(error, 0)]})
    with pytest.raises(StageFailed):
        run(stages)
    assert stages.calls["talker"] == 1


def test_stream_that_ends_without_its_final_output_is_a_failure() -> None:
    class Truncating(FlakyStages):
        def _outputs(self, stage: str, request: Any) -> list[StageOutput]:
            outputs = super()._outputs(stage, request)
            return outputs[:-1] if stage == "talker" else outputs

    with pytest.raises(StageFailed) as info:
        run(Truncating({}))
    assert isinstance(info.value.cause, IncompleteStageStream)
    assert from_failure(info.value, "r").status == 503


def test_a_call_refused_when_it_starts_names_the_stage() -> None:
    """Serve refuses the call when the stage's queue is full: the error names the stage, 503 overloaded."""
    from ray.serve.exceptions import BackPressureError

    class FullTalker(FlakyStages):
        async def _attempt(self, stage: str, request: Any) -> AsyncIterator[StageOutput]:
            if stage == "talker":
                raise BackPressureError(1, 1)
            async for output in super()._attempt(stage, request):
                yield output

    with pytest.raises(StageFailed) as info:
        run(FullTalker({}))
    error = from_failure(info.value, "r")
    assert info.value.stage == "talker" and (error.status, error.code) == (503, "overloaded")
    assert "'talker'" in error.message


def test_failure_status_mapping() -> None:
    from ray.serve.exceptions import BackPressureError

    assert from_failure(StageFailed("thinker", wrapped(InvalidStageInput("too long"))), "r").status == 400
    assert from_failure(StageFailed("code2wav", wrapped(OwnerDiedError("ff" * 28, None, ""))), "r").status == 503
    overloaded = from_failure(StageFailed("talker", BackPressureError(3, 2)), "r")
    assert (overloaded.status, overloaded.retry_after_s) == (503, 1)
    told = from_failure(StageFailed("talker", BackPressureError(3, 2, status_code=429, retry_after_s=2.5)), "r")
    assert (told.status, told.retry_after_s) == (429, 3)
    hidden = from_failure(StageFailed("talker", wrapped(ValueError("secret internals"))), "r", log=False)
    assert hidden.status == 500 and "secret" not in hidden.message


# ---- integration: kill a talker replica under load ---------------------------------------------

N_REQUESTS = 8


pytestmark = [SHARED_GRAPH, pytest.mark.tiny_variant(0)]


@pytest.fixture(scope="module")
def graph(graphs) -> Any:
    graphs.ensure("tiny_omni.yaml", TWO_PADDED_TALKERS)
    return graphs


def one_request(base_url: str, stream: bool) -> dict[str, Any]:
    """Send one request; classify the outcome and measure the audio it delivered."""
    body = {**BODY, "stream": stream}
    started = time.monotonic()
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        if not stream:
            reply = client.post(f"{base_url}/v1/chat/completions", json=body)
            outcome = {"stream": False, "status": reply.status_code, "seconds": time.monotonic() - started}
            if reply.status_code == 200:
                message = reply.json()["choices"][0]["message"]
                outcome.update(ok=True, samples=samples(message["audio"]["data"]), text=message["content"])
            else:
                outcome.update(ok=False, error=reply.json()["error"], retry_after=reply.headers.get("retry-after"))
            return outcome
        with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as reply:
            events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
        outcome = {"stream": True, "status": reply.status_code, "seconds": time.monotonic() - started}
        if reply.status_code != 200:
            return {**outcome, "ok": False, "error": json.loads(reply.read())["error"]}
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        errors = [c["error"] for c in chunks if "error" in c]
        audio = [c["choices"][0]["delta"]["audio"]["data"] for c in chunks if c.get("modality") == "audio"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("modality") == "text")
        done = bool(events) and events[-1] == "[DONE]"
        assert done != bool(errors), f"a stream ends with [DONE] xor an error event: {events[-2:]}"
        if errors:
            assert events[-1] == json.dumps(chunks[-1], separators=(",", ":")) and len(errors) == 1
            return {**outcome, "ok": False, "error": errors[0]}
        return {**outcome, "ok": True, "samples": sum(samples(a) for a in audio), "text": text}


def ingress_log_lines(pattern: str) -> list[str]:
    import ray

    session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    return [
        line
        for log in (session / "logs" / "serve").glob("replica_omni_ingress_*.log")
        for line in log.read_text(errors="replace").splitlines()
        if pattern in line
    ]


def test_killing_a_talker_replica_under_load(graph) -> None:
    import ray

    reference = one_request(graph.base_url, stream=False)
    assert reference["ok"], reference
    full = reference["samples"]
    retries_before = len(ingress_log_lines("retrying once"))

    talkers = replica_names("talker")
    assert len(talkers) == 2
    code2wav_calls = graph.handle("code2wav").stats.remote().result()["requests_total"]
    with concurrent.futures.ThreadPoolExecutor(N_REQUESTS) as pool:
        futures = [pool.submit(one_request, graph.base_url, i % 2 == 1) for i in range(N_REQUESTS)]
        # Both talker replicas are busy with some requests and hold others in their engine queue.
        wait_until(
            lambda: graph.handle("code2wav").stats.remote().result()["requests_total"] >= code2wav_calls + 3,
            60,
            "the load to reach code2wav",
        )
        ray.kill(ray.get_actor(talkers[0], namespace="serve"), no_restart=True)
        outcomes = [f.result() for f in futures]

    for outcome in outcomes:
        assert outcome["seconds"] < CLIENT_TIMEOUT_S
        if outcome["ok"]:
            # Success means the whole reply: the same audio length as the undisturbed reference.
            assert outcome["status"] == 200 and outcome["samples"] == full, outcome
            assert outcome["text"] == reference["text"]
        else:
            error = outcome["error"]
            assert error["type"] == "service_unavailable", outcome
            assert "'talker'" in error["message"] or "'code2wav'" in error["message"], outcome
            assert error["code"] == "stage_unavailable" and set(error) == {"message", "type", "param", "code"}
            if not outcome["stream"]:
                assert outcome["status"] == 503 and outcome["retry_after"], outcome
    failed = [o for o in outcomes if not o["ok"]]
    retries = len(ingress_log_lines("retrying once")) - retries_before
    print(f"{len(outcomes) - len(failed)} complete, {len(failed)} failed with 503, {retries} stage calls retried")
    # Only requests the killed replica had started talking for (or whose codec chunks it still owned)
    # may fail; Serve spreads the load over both talkers by queue length, so that is at most about half.
    # Requests waiting in its engine queue had produced nothing: retried on the other replica.
    assert len(failed) <= N_REQUESTS // 2 + 1, outcomes
    assert retries >= 1

    # Recovery without a restart: Serve replaces the replica, /health is 200, requests work.
    def recovered() -> bool:
        now = replica_names("talker")
        return httpx.get(f"{graph.base_url}/health", timeout=30).status_code == 200 and (
            len(now) == 2 and talkers[0] not in now
        )

    wait_until(recovered, 180, "the graph to recover (health 200, the killed talker replaced)", interval_s=1)
    after = [one_request(graph.base_url, stream) for stream in (False, True)]
    assert all(o["ok"] and o["samples"] == full for o in after), after
