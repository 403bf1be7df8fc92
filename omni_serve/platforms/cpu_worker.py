"""vLLM-Omni stage workers on CPU: vLLM-Omni's GPU model runners composed with vLLM's CPU runner.

``GPUARModelRunner`` / ``GPUGenerationModelRunner`` hold everything vLLM-Omni adds to a
stage (hidden-state capture, the talker's code predictor, payload buffers, codec
generation); vLLM's ``CPUModelRunner`` turns ``GPUModelRunner`` into a CPU runner
(device buffers aliased to host buffers, no CUDA streams/events, CPU slot-mapping
kernels). Both extend ``GPUModelRunner``, so the composition's MRO runs vLLM-Omni's
layer first and the CPU layer beneath it. The workers are vLLM's ``CPUWorker`` plus
vLLM-Omni's ``OmniWorkerMixin``, with the runner replaced after ``init_device`` as
vLLM-Omni's own XPU workers do, step pacing (engine arg ``min_step_s``; inert without it) from
:class:`~omni_serve.platforms.paced.PacedSteps`, and empty steps that wait instead of spinning
(:class:`~omni_serve.platforms.quiet.QuietIdleSteps`).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.base import OmniGPUWorkerBase
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

from omni_serve.platforms.paced import PacedSteps
from omni_serve.platforms.quiet import QuietIdleSteps


class _NoGraphSizes:
    """vLLM's CpuPlatform captures no graphs and leaves ``max_cudagraph_capture_size`` None, but
    vLLM-Omni's runner sizes the talker's code-predictor buffers with
    ``max(max_num_reqs, max_cudagraph_capture_size)`` (``worker/gpu_model_runner.py``,
    ``_init_talker_mtp``) and fails on None. 0 is the value vLLM-Omni's own deploy configs give
    platforms without graphs (``deploy/qwen3_omni_moe.yaml``, xpu). No CPU platform upstream:
    vllm-project/vllm-omni#1095 (open PR #4665)."""

    def __init__(self, vllm_config: Any, device: Any) -> None:
        if vllm_config.compilation_config.max_cudagraph_capture_size is None:
            vllm_config.compilation_config.max_cudagraph_capture_size = 0
        super().__init__(vllm_config, device)  # type: ignore[call-arg]  # a mixin: vLLM's runner is next in the MRO


class CPUARModelRunner(_NoGraphSizes, GPUARModelRunner, CPUModelRunner):
    """Thinker / talker runner on CPU."""


class CPUGenerationModelRunner(_NoGraphSizes, GPUGenerationModelRunner, CPUModelRunner):
    """Code2wav (non-autoregressive generation) runner on CPU."""


class _OmniCPUWorker(QuietIdleSteps, PacedSteps, OmniWorkerMixin, CPUWorker):
    model_runner_cls: type[CPUModelRunner]

    def init_device(self) -> None:
        super().init_device()
        # vLLM-Omni's hooks live in the v1 runners only (its XPU workers force v1 the same way).
        self.use_v2_model_runner = False
        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)

    def encoder_loaded(self) -> bool:
        """Whether the stage's model has its audio encoder: a ``collective_rpc`` vLLM-Omni's Voxtral TTS speech
        adapter makes before it accepts ``ref_audio`` (voice cloning). vLLM-Omni defines it on its GPU worker base
        (``OmniGPUWorkerBase``, a ``GPUWorker``), which a CPU worker cannot inherit; without it the RPC fails on
        every stage and every clone request is refused as if the checkpoint had no encoder."""
        return OmniGPUWorkerBase.encoder_loaded(self)  # reads only self.model_runner, which this worker has


class CPUARWorker(_OmniCPUWorker):
    model_runner_cls = CPUARModelRunner


class CPUGenerationWorker(_OmniCPUWorker):
    model_runner_cls = CPUGenerationModelRunner
