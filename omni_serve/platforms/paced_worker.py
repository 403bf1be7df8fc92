"""vLLM's CPU worker and multiprocess executor for paced engines (``min_step_s`` set).

Why the worker paces, and how the value gets here: :mod:`omni_serve.platforms.paced`. The executor
is the other half of "waited without a core": vLLM's CPU platform always runs its workers in
processes of their own (the ``mp`` executor, even for one worker), and the EngineCore reads each
step's reply through a shared-memory queue whose reader busy-loops (``sched_yield``) for a second
after each read (``SpinCondition.busy_loop_s``, 1 s in vLLM 0.30, no setting). With steps paced
under a second, the EngineCore would spin a core through every paced wait of its worker, so a paced
engine's executor makes those readers wait on the queue's notification socket instead (about
0.1 ms more a step; the worker's own reader spins only while the EngineCore books a step's outputs).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.worker.cpu_worker import CPUWorker

from omni_serve.pacing import configured_min_step
from omni_serve.platforms.paced import PacedSteps


class PacedCPUWorker(PacedSteps, CPUWorker):
    """vLLM's CPU worker (the ``vllm`` family on vLLM's CPU platform), each engine step paced."""


class PacedMultiprocExecutor(MultiprocExecutor):
    """vLLM's multiprocess executor whose EngineCore-side reply readers idle-wait while its workers pace."""

    def _init_executor(self) -> None:
        super()._init_executor()
        if configured_min_step(self.vllm_config.additional_config):
            for queue in self.response_mqs:
                queue._spin_condition.busy_loop_s = 0.0  # vLLM 0.30 reads it on every wait


def paced_executor(executor_class: Any) -> Any:
    """The executor class to run paced workers under (vLLM's multiprocess one swapped for ours)."""
    return PacedMultiprocExecutor if executor_class is MultiprocExecutor else executor_class
