"""vLLM's CPU worker for paced engines (``min_step_s`` set) of the ``vllm`` family.

Why the worker paces, and how the value gets here: :mod:`omni_serve.platforms.paced`. A paced engine
runs under :class:`~omni_serve.platforms.quiet.QuietMultiprocExecutor`, the other half of "waited
without a core": vLLM's CPU platform always runs its workers in processes of their own (the ``mp``
executor, even for one worker), and with steps paced under a second the EngineCore would otherwise
spin a core through every paced wait of its worker.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from omni_serve.platforms.paced import PacedSteps


class PacedCPUWorker(PacedSteps, CPUWorker):
    """vLLM's CPU worker (the ``vllm`` family on vLLM's CPU platform), each engine step paced."""
