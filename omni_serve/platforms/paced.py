"""Step pacing inside vLLM / vLLM-Omni engine processes: mixins over their workers and model runners.

``min_step_s`` (:mod:`omni_serve.pacing`) must slow the engine itself, once per engine step for the
whole batch, in whatever process runs the steps. Where each hook sits, read in vLLM 0.30 /
vLLM-Omni 0.30, and why there:

- :class:`PacedSteps`, before a vLLM worker class. vLLM's EngineCore calls ``execute_model`` and,
  when that returns None, ``sample_tokens`` on its worker once per scheduler step, for the whole
  batch; the worker runs in the EngineCore process (``uni`` executor) or its own (``mp``) and is
  built there from the ``VllmConfig``, whose ``additional_config`` carries the value. So a batch of
  8 takes one paced step and nothing per request is involved. The alternatives were worse: a
  ``worker_extension_cls`` is appended *after* the worker's bases and may not override its methods
  (``WorkerWrapperBase.init_worker``); an executor subclass sees a step as futures that differ per
  executor; the EngineCore class cannot be chosen from engine args. The worker classes are the
  platform's own: vLLM's ``CPUWorker`` (:mod:`.paced_worker`, named in the ``vllm`` family's
  ``worker_cls``) and omni_serve's CPU workers of vLLM-Omni (:mod:`.cpu_worker`).
- :class:`PacedStepwise`, before vLLM-Omni's diffusion model runner. With ``step_execution`` the
  ``DiffusionEngine`` schedules one denoising step at a time and its worker runs each as one
  ``execute_stepwise`` call of the runner; ``OmniDiffusionConfig.diffusion_model_runner_cls`` (vLLM-Omni's
  own override, resolved before the platform default) names the runner (:mod:`.paced_diffusion`) and
  its ``additional_config`` carries the value to the worker process.

Both mixins are inert without the value. Steps that schedule no tokens (only finished requests to
clean up) are not paced: a device spends nothing on them.
"""

from __future__ import annotations

from typing import Any

from omni_serve.pacing import StepPacer, configured_min_step


class PacedSteps:
    """Mixin before a vLLM worker class: paces each engine step (``execute_model`` [+ ``sample_tokens``])."""

    vllm_config: Any  # set by vLLM's WorkerBase

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pacer = StepPacer(configured_min_step(self.vllm_config.additional_config))
        self._step_open = False  # a paced step whose execute_model left the rest to sample_tokens

    def execute_model(self, scheduler_output: Any) -> Any:
        paced = bool(self._pacer.min_step_s) and scheduler_output.total_num_scheduled_tokens > 0
        if paced:
            self._pacer.step_started()
        output = super().execute_model(scheduler_output)  # type: ignore[misc]  # the worker is next in the MRO
        if output is None:  # the runner samples in sample_tokens(), called next: the step ends there
            self._step_open = paced
        elif paced:
            self._pacer.step_done()
        return output

    def sample_tokens(self, grammar_output: Any) -> Any:
        output = super().sample_tokens(grammar_output)  # type: ignore[misc]
        if self._step_open:
            self._step_open = False
            self._pacer.step_done()
        return output


class PacedStepwise:
    """Mixin before a vLLM-Omni diffusion model runner: paces each ``execute_stepwise`` (one denoising step), and
    each whole forward (``execute_model``: request mode, or a pipeline without step execution such as GLM-Image's
    DiT) at its request's steps times ``min_step_s``, the time a device spends on those steps in one forward."""

    od_config: Any  # set by the runner

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pacer = StepPacer(configured_min_step(self.od_config.additional_config))

    def execute_stepwise(self, scheduler_output: Any) -> Any:
        self._pacer.step_started()
        output = super().execute_stepwise(scheduler_output)  # type: ignore[misc]  # the runner is next in the MRO
        self._pacer.step_done()
        return output

    def execute_model(self, req: Any, *args: Any, **kwargs: Any) -> Any:
        steps = int(getattr(req.sampling_params, "num_inference_steps", None) or 1)
        forward = StepPacer(self._pacer.min_step_s * steps, self._pacer.cancelled)
        forward.step_started()
        output = super().execute_model(req, *args, **kwargs)  # type: ignore[misc]
        forward.step_done()
        return output
