"""vLLM's CPU worker with step pacing: the ``vllm`` family's ``worker_cls`` when ``min_step_s`` is set.

Why the worker, and how the value gets here: :mod:`omni_serve.platforms.paced`.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from omni_serve.platforms.paced import PacedSteps


class PacedCPUWorker(PacedSteps, CPUWorker):
    """vLLM's CPU worker (the ``vllm`` family on vLLM's CPU platform), each engine step paced."""
