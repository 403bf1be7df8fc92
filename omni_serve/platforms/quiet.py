"""Engine waits that leave the cores to the other stages: vLLM's two spin-waits, made to wait without a core.

On a GPU host each stage's EngineCore has cores to spare, and vLLM spends them on latency: its
EngineCore reads each step's reply from its worker through a shared-memory queue whose reader
busy-loops (``sched_yield``) for a second after each read (``SpinCondition.busy_loop_s``, 1 s in vLLM
0.30, no setting), and it steps its worker even when it has nothing to schedule (``EngineCore.step``
calls ``execute_model`` while a request waits, e.g. a streamed talker in vLLM-Omni's
``WAITING_FOR_CHUNK`` for its next thinker chunk), so a waiting stage round-trips to its worker as
fast as the two processes can spin. On a CPU host where three stages' six engine processes share
two cores, both spins take the cores the other stages compute on.

- :class:`QuietMultiprocExecutor`: the EngineCore waits for its workers' replies on the queue's
  notification socket, re-checking the buffer every millisecond (:func:`quiet_reader`). Paced
  engines run under it (their steps are waits). Unpaced CPU engines do not: it cut their EngineCores'
  CPU ~6 x but made every step wait for the EngineCore's wakeup on a loaded 2-core host (c=1 e2e
  1.57 -> 1.90 s native, 1.90 -> 2.12 s omni_serve, c=4 throughput down on both: one scratch run
  of vs_vllm_omni's load), so for unpaced steps vLLM's spin is the faster trade.
- :class:`QuietIdleSteps` (in omni_serve's CPU workers, :mod:`.cpu_worker`): a step with nothing
  scheduled returns after 1 ms, so a waiting stage polls its input at 1 kHz (the back-off vLLM-Omni's
  own connector receive loop uses, ``transfer_adapter/base.py``) instead of spinning two processes.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

IDLE_STEP_S = 0.001
REPLY_POLL_MS = 1


class QuietMultiprocExecutor(MultiprocExecutor):
    """vLLM's multiprocess executor whose EngineCore-side reply readers wait on a socket, not a spin."""

    def _init_executor(self) -> None:
        super()._init_executor()
        for queue in self.response_mqs:
            quiet_reader(queue)


def quiet_reader(queue: Any) -> None:
    """A reader of vLLM's shared-memory ``MessageQueue`` that waits without spinning, ``REPLY_POLL_MS`` at a time.

    Waiting on the writer's notification socket alone (vLLM's idle mode) can miss a message: a reader
    slept until vLLM's 5 s recheck (``SHM_READER_RECHECK_INTERVAL_MS``) under vs_vllm_omni's load
    (native's c=1 e2e 1.4 -> 9.0 s). The notification is likely dropped by the writer's PUB socket
    (send high-water mark 1) while ZeroMQ still counts the previous one as queued; no upstream issue
    found. So each wait lasts at most 1 ms, after which the reader re-checks the buffer's flag itself:
    a lost notification costs 1 ms, and the core stays with the worker.
    """
    condition = queue._spin_condition
    condition.busy_loop_s = 0.0  # vLLM 0.30 reads it on every wait: never spin
    wait = condition.wait

    def capped(timeout_ms: int | None = None) -> None:
        wait(timeout_ms=REPLY_POLL_MS if timeout_ms is None else min(timeout_ms, REPLY_POLL_MS))

    condition.wait = capped


def quiet_executor(executor_class: Any) -> Any:
    """The executor class to run under: vLLM's multiprocess one swapped for ours, any other kept."""
    return QuietMultiprocExecutor if executor_class is MultiprocExecutor else executor_class


class QuietIdleSteps:
    """Mixin before a vLLM worker class: an engine step with nothing scheduled returns after ``IDLE_STEP_S``."""

    def execute_model(self, scheduler_output: Any) -> Any:
        output = super().execute_model(scheduler_output)  # type: ignore[misc]  # the worker is next in the MRO
        if not scheduler_output.total_num_scheduled_tokens:
            time.sleep(IDLE_STEP_S)
        return output
