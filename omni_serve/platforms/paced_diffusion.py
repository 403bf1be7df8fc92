"""vLLM-Omni's diffusion model runner with step pacing: the ``vllm_omni_diffusion`` family's runner when
``min_step_s`` is set (``OmniDiffusionConfig.diffusion_model_runner_cls``).

Why the runner, and how the value gets here: :mod:`omni_serve.platforms.paced`.
"""

from __future__ import annotations

from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

from omni_serve.platforms.paced import PacedStepwise


class PacedDiffusionModelRunner(PacedStepwise, DiffusionModelRunner):
    """vLLM-Omni's diffusion model runner, each scheduled denoising step paced."""
