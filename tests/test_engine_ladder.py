"""The exception ladder every engine runs under (omni_serve.engines.ladder), rung by rung, with a fake engine.

No Ray, no engine library: the fake registers its engine request in ``self.calls`` as the real
families do, and records what the ladder asked it to abort.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from ray.exceptions import RayTaskError

from omni_serve.api.failure_status import from_failure
from omni_serve.engines.base import StageEngine
from omni_serve.exceptions import EngineDeadError, EngineError, InvalidStageInput, StageFailed
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, SamplingParams, StageOutput, StageRequest


class LibraryDead(Exception):
    """What an engine library raises once its engine process is gone (vLLM's EngineDeadError)."""


class LibraryBadRequest(Exception):
    """An engine library's own validation error (vLLM's VLLMValidationError)."""


class FakeEngine(StageEngine):
    """Yields ``outputs`` then finishes; ``hold`` parks it after the first output; ``fail`` raises there."""

    def __init__(self, fail: BaseException | None = None, hold: bool = False, outputs: int = 2):
        super().__init__("talker", {})
        self.fail, self.hold, self.outputs = fail, hold, outputs
        self.aborted: list[str] = []  # engine requests the registry handed to _abort
        self.abort_calls: list[str] = []  # request ids abort() was called with
        self.streams = 0
        self.probe_error: BaseException | None = None
        self.parked = asyncio.Event()

    async def start(self) -> None:
        pass

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        self.streams += 1
        engine_id = self.calls.mint(request.request_id)
        with self.calls.track(request.request_id, engine_id) as call:
            for n in range(self.outputs):
                if n == 1 and self.fail is not None:
                    raise self.fail
                if n == 1 and self.hold:
                    self.parked.set()
                    await asyncio.Event().wait()  # the engine is busy: only a cancellation ends this
                last = n == self.outputs - 1
                if last:
                    call.finish()
                yield StageOutput(stage=self.stage_name, text=str(n), finished=last, finish_reason=FinishReason.STOP)

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        await super().abort(request_id)

    async def _abort(self, handles: list[Any]) -> None:
        self.aborted.extend(handles)

    def dead_reason(self, err: BaseException) -> str | None:
        return "its engine process died" if isinstance(err, LibraryDead) else None

    def invalid_input(self, err: BaseException) -> InvalidStageInput | None:
        return InvalidStageInput(f"top_k: {err}", "top_k") if isinstance(err, LibraryBadRequest) else None

    async def probe_health(self) -> None:
        if self.probe_error is not None:
            raise self.probe_error


@pytest.fixture
def logged() -> Iterator[list[logging.LogRecord]]:
    """Records of the ``ray.serve`` logger (Ray stops it propagating to pytest's caplog)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def call(rid: str = "call-1") -> StageRequest:
    return StageRequest(request_id=rid, sampling=SamplingParams())


async def collect(engine: StageEngine, rid: str = "call-1") -> list[StageOutput]:
    return [out async for out in engine.generate(call(rid), None)]


def test_a_call_that_finishes_passes_its_outputs_and_aborts_nothing() -> None:
    engine = FakeEngine()
    outs = asyncio.run(collect(engine))
    assert [o.text for o in outs] == ["0", "1"] and outs[-1].finished
    assert engine.abort_calls == engine.aborted == [] and engine.calls.stats() == {"stream_calls": 0, "aborted": 0}


def test_cancelled_while_the_engine_works_aborts_its_engine_request() -> None:
    """(a) The cancellation reaches the family's stream first (it unwinds before the ladder sees it)."""
    engine = FakeEngine(hold=True)

    async def go() -> None:
        task = asyncio.create_task(collect(engine, "gone"))
        await engine.parked.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert engine.aborted == ["gone-0"]
    assert engine.calls.stats() == {"stream_calls": 0, "aborted": 1} and engine.calls.requests() == 0


def test_closed_at_a_yield_aborts_its_engine_request() -> None:
    """(a) GeneratorExit: the consumer closes the stream between two outputs."""
    engine = FakeEngine(outputs=3)

    async def go() -> None:
        stream = engine.generate(call("closed"), None)
        await anext(stream)
        await stream.aclose()

    asyncio.run(go())
    assert engine.aborted == ["closed-0"] and engine.calls.requests() == 0


def test_closed_after_its_final_output_aborts_nothing() -> None:
    engine = FakeEngine(outputs=1)

    async def go() -> None:
        stream = engine.generate(call(), None)
        assert (await anext(stream)).finished
        await stream.aclose()

    asyncio.run(go())
    assert engine.abort_calls == [] and engine.aborted == [] and engine.calls.stats()["aborted"] == 0


@pytest.mark.parametrize(
    "raised", [LibraryDead("zmq socket closed: secret"), EngineDeadError("talker", "its engine process died")]
)
def test_a_dead_engine_raises_engine_dead_and_fails_every_later_call_and_health_check(raised: Exception) -> None:
    """(b) Recognised by the family's hook, or raised as EngineDeadError by the family itself."""
    engine = FakeEngine(fail=raised)
    with pytest.raises(EngineDeadError) as info:
        asyncio.run(collect(engine))
    err = info.value
    assert (err.stage, err.reason) == ("talker", "its engine process died")
    assert str(err) == "stage talker: engine dead (its engine process died)" and "secret" not in str(err)
    assert engine.aborted == []  # nothing to abort in a dead engine
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.check_health())  # Serve's health check fails: the replica is replaced
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine))
    assert engine.streams == 1  # refused before the family is asked


def test_engine_dead_error_survives_pickling_and_maps_to_503() -> None:
    err = pickle.loads(pickle.dumps(EngineDeadError("thinker", "its EngineCore process died")))
    assert (err.stage, err.reason, str(err)) == (
        "thinker",
        "its EngineCore process died",
        "stage thinker: engine dead (its EngineCore process died)",
    )
    wrapped = RayTaskError("generate", "Traceback ...", err).as_instanceof_cause()  # as Ray re-raises it
    api = from_failure(StageFailed("thinker", wrapped), "r", log=False)
    assert (api.status, api.code, api.type, api.retry_after_s) == (503, "engine_dead", "service_unavailable", 5)
    assert api.message == "stage 'thinker' engine died; retry later"


def test_a_health_probe_that_finds_the_engine_dead_marks_it() -> None:
    engine = FakeEngine()
    engine.probe_error = RuntimeError("not started")
    with pytest.raises(RuntimeError, match="not started"):  # not a death: raised as it is
        asyncio.run(engine.check_health())
    assert engine.dead is None
    engine.probe_error = LibraryDead()
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.check_health())
    engine.probe_error = None
    with pytest.raises(EngineDeadError, match="its engine process died"):
        asyncio.run(engine.check_health())  # dead for good: the probe alone no longer decides


def test_bad_input_passes_through_and_frees_the_engine() -> None:
    """(c) InvalidStageInput as raised; a library's own validation error mapped by the family's hook."""
    bad = InvalidStageInput("voice: unknown voice 'x'", "voice")
    engine = FakeEngine(fail=bad)
    with pytest.raises(InvalidStageInput) as info:
        asyncio.run(collect(engine, "bad"))
    assert info.value is bad and engine.aborted == ["bad-0"] and engine.dead is None
    engine = FakeEngine(fail=LibraryBadRequest("must be >= 0"))
    with pytest.raises(InvalidStageInput) as info:
        asyncio.run(collect(engine))
    assert (info.value.param, str(info.value)) == ("top_k", "top_k: must be >= 0")


def test_anything_else_is_logged_and_raised_as_engine_error_without_its_text(logged) -> None:
    """(d) The traceback goes to the replica log, the caller gets the stage and the call only."""
    engine = FakeEngine(fail=ValueError("secret internals"))
    with pytest.raises(EngineError) as info:
        asyncio.run(collect(engine, "boom"))
    assert type(info.value) is EngineError and "secret" not in str(info.value)
    assert str(info.value) == "stage talker: the engine failed on call boom; see the replica log"
    assert info.value.__cause__ is None and info.value.__suppress_context__
    [record] = [r for r in logged if "failed" in r.getMessage()]
    assert isinstance(record.exc_info[1], ValueError)
    assert engine.aborted == ["boom-0"] and engine.dead is None


def test_an_engine_error_the_family_wrote_passes_through() -> None:
    own = EngineError("stage talker: the thinker's handoff has no assistant turn to speak")
    with pytest.raises(EngineError) as info:
        asyncio.run(collect(FakeEngine(fail=own)))
    assert info.value is own


def test_a_failing_abort_never_hides_the_cancellation(logged) -> None:
    engine = FakeEngine(hold=True)

    async def broken_abort(handles: list[Any]) -> None:
        raise RuntimeError("abort failed")

    engine._abort = broken_abort  # type: ignore[method-assign]

    async def go() -> None:
        task = asyncio.create_task(collect(engine))
        await engine.parked.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert any("aborting call call-1 failed" in r.getMessage() for r in logged)
