"""A graph's ``distributed_executor_backend: uni`` honoured on vLLM's CPU platform, which turns it into ``mp``.

vLLM's ``CpuPlatform.check_and_update_config`` replaces ``uni`` with ``mp`` whenever vLLM runs its
EngineCore in a process of its own, because a worker created in an already running process cannot get
the OpenMP environment (``LD_PRELOAD`` of PyTorch's libgomp, thread count, binding) that the ``mp``
executor gives the worker process it spawns. Under Serve that reason does not hold: the config is built
in the replica, the platform writes the ``LD_PRELOAD`` into the replica's environment while building it,
and the EngineCore process is spawned afterwards with that environment and the replica's
``OMP_NUM_THREADS`` (Ray sets it to the replica's whole CPUs, at least 1). A ``uni`` EngineCore then runs
the worker in its own process: one engine process per stage instead of two, each importing vLLM, and no
shared-memory queue between them, whose reader spins on a core for a second after each step
(:mod:`.quiet`). On a GPU vLLM already picks ``uni`` for one device, so this only gives CPU graphs what
they ask for; a graph that sets nothing keeps vLLM's choice.
"""

from __future__ import annotations

from typing import Any


def honour_uni(vllm_config: Any, asked: str | None) -> bool:
    """Put ``uni`` back where the graph asked for it and vLLM's CPU platform replaced it; True if it did.

    The executor class is then ``vllm.v1.executor.Executor.get_class(vllm_config)``.
    """
    parallel = vllm_config.parallel_config
    if asked != "uni" or parallel.distributed_executor_backend != "mp" or parallel.world_size != 1:
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    parallel.distributed_executor_backend = "uni"
    return True
