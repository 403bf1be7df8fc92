"""The ``vllm_omni_diffusion`` engine family: the diffusion kind of vLLM-Omni stage, image and video DiTs on
vLLM-Omni 0.30's own diffusion engine.

One replica owns one ``vllm_omni.diffusion.diffusion_engine.DiffusionEngine``, built and
driven the way vLLM-Omni 0.30 serves a lone diffusion stage (``InlineStageDiffusionClient``),
on GPUs, or on CPU through omni_serve's platform (:mod:`omni_serve.platforms.cpu`: one device, torch
SDPA attention):

1. ``OmniDiffusionConfig.from_kwargs(**diffusion_config_kwargs(args))``
   (:mod:`omni_serve.engines.vllm_omni.diffusion_args`: the engine args and the config they make);
2. ``od_config.enrich_config()`` resolves the pipeline class from the checkpoint's
   ``model_index.json``; that class, what vLLM-Omni declares it makes (``get_diffusion_output_type``) and the
   stage's ``pipeline`` pick the request mapping, once
   (:func:`omni_serve.engines.vllm_omni.diffusion_requests.requests_for`): a lone image or video DiT whose pipeline
   class has hooks (Qwen-Image, Wan 2.2), or the DiT stage of a vLLM-Omni pipeline fed by an upstream
   (``pipeline``, ``stage_id``: its declared ``model_arch``), whose requests its upstream makes; anything else is
   refused at start;
3. ``DiffusionEngine.make_engine(od_config)`` builds the executor (``uni`` in-process for
   one GPU, ``mp`` worker processes otherwise), loads the weights and runs vLLM-Omni's
   warm-up request;
4. each request is an ``OmniDiffusionRequest`` (the mapping's plan) consumed through
   ``DiffusionEngine.step_streaming`` on the replica's event loop; the mapping makes the reply.

Cancellation, as far as 0.30 allows: a cancelled call (the ladder aborts it) or :meth:`abort`
calls ``DiffusionEngine.abort``, which drops a queued request at once. A request already inside
a full forward (the default request mode) runs to its end and the result is discarded;
with ``step_execution: true`` the engine schedules one denoising step at a time and an
abort takes effect at the next step. Qwen-Image does not implement vLLM-Omni's
cooperative in-forward cancellation (``supports_request_cancellation``).
Step pacing (``min_step_s``, :mod:`omni_serve.pacing`): in that mode each scheduled denoising step
takes at least ``min_step_s`` in the engine's model runner; a whole forward (request mode, or a pipeline
without step execution: GLM-Image's DiT, Wan 2.2) at least its steps times ``min_step_s``. In step mode the
call also reports progress (``StageOutput.progress``: the steps the engine's step scheduler has run,
over the request's steps); otherwise only "admitted" (progress 0) and the result. Pipelines without
vLLM-Omni's step execution (Wan 2.2) run a full forward whatever this says.

``stats()`` reports ``waiting`` (submitted, not yet admitted by the diffusion scheduler)
and ``running`` (admitted), from the engine's request-started events
(``emit_request_lifecycle``), which ``omni_serve.graph.autoscaling`` reads.

``load_format: dummy`` has no image path in 0.30's diffusion engine (it skips building the
pipeline), so random-weight tests point ``model`` at a small diffusers-layout checkpoint: ``tiny``
(Qwen-Image) or another registered name (:mod:`omni_serve.checkpoints`, e.g. ``tiny-wan2.2-ti2v``).
Only the pydantic ``EngineArgs`` is imported at graph validation; ``vllm_omni`` is imported
in :meth:`VllmOmniDiffusionEngine.start`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from omni_serve.engines.base import StageEngine
from omni_serve.engines.family import Family
from omni_serve.engines.vllm_omni.diffusion_args import TINY, EngineArgs, diffusion_config_kwargs, unknown_config_fields
from omni_serve.engines.vllm_omni.diffusion_requests import PipelineRequests, Planned, Requests, requests_for
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, Modality, StageOutput, StageRequest, VideoRules

logger = logging.getLogger("ray.serve")

# How often a step-scheduled call looks at its request's step index (progress).
PROGRESS_POLL_S = 0.25


def create(stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    return VllmOmniDiffusionEngine(stage_name, engine_args)


def input_modalities(args: EngineArgs) -> set[Modality]:
    """An editing stage takes the source image as chat input (and /v1/images/edits); the others text only."""
    return {Modality.TEXT, Modality.IMAGE} if args.image_input else {Modality.TEXT}


class VllmOmniDiffusionEngine(StageEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.args = EngineArgs.model_validate(engine_args)
        self._engine: Any = None  # vllm_omni DiffusionEngine
        self._state: dict[str, str] = {}  # engine request id -> "waiting" | "running"
        self._served = 0
        self._requests: Requests | None = None  # the stage's request mapping (chosen at start)

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        import vllm_omni  # noqa: F401  - first: patches vLLM in this process

        self._engine = await asyncio.to_thread(self._launch)
        self._engine.executor.register_failure_callback(self._mark_dead)

    def _launch(self) -> Any:
        """Build the OmniDiffusionConfig, the request mapping and the DiffusionEngine (blocking; runs in a thread)."""
        from vllm_omni.diffusion.data import OmniDiffusionConfig
        from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
        from vllm_omni.diffusion.io_support import get_diffusion_output_type
        from vllm_omni.platforms import current_omni_platform

        from omni_serve.checkpoints import resolve

        model = resolve(self.args.model, tiny=TINY)
        kwargs = diffusion_config_kwargs(self.args, model)
        unknown = unknown_config_fields(kwargs)
        if unknown:
            raise EngineError(f"stage {self.stage_name}: vLLM-Omni's diffusion config has no field(s) {unknown}")
        gpus, devices = self.args.parallel.world_size, current_omni_platform.get_device_count()
        if devices < gpus:  # omni_serve's CPU platform counts one device
            raise EngineError(
                f"stage {self.stage_name}: the parallel options need {gpus} device(s) in the replica, "
                f"{devices} visible; set ray_actor_options.num_gpus: {gpus}"
            )
        try:
            od_config = OmniDiffusionConfig.from_kwargs(**kwargs)
        except (AssertionError, TypeError, ValueError) as err:  # DiffusionParallelConfig validates with asserts
            raise EngineError(f"stage {self.stage_name}: invalid vLLM-Omni diffusion config: {err}") from err
        od_config.enrich_config()
        name = od_config.model_class_name
        self._requests = requests_for(self.stage_name, self.args, name, get_diffusion_output_type(name), model)
        return DiffusionEngine.make_engine(od_config)

    def _mark_dead(self) -> None:  # the executor's failure callback (a worker process died)
        self.mark_dead("its diffusion executor died")

    async def probe_health(self) -> None:
        if self._engine is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        self._engine.executor.check_health()

    def invalid_input(self, err: BaseException) -> InvalidStageInput | None:
        from vllm_omni.errors import OmniClientError

        return InvalidStageInput(f"stage {self.stage_name}: {err}") if isinstance(err, OmniClientError) else None

    def video_rules(self) -> VideoRules | None:
        return self._requests.video_rules if self._requests is not None else None

    def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def stats(self) -> dict[str, Any]:
        states = list(self._state.values())
        return {
            "waiting": states.count("waiting"),
            "running": states.count("running"),
            "client_requests": self.calls.requests(),
            "served": self._served,
            "aborted": self.calls.aborted,
        }

    async def _abort(self, handles: list[str]) -> None:
        if self._engine is not None:
            self._engine.abort(handles)

    # -- requests ----------------------------------------------------------

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        from vllm_omni.diffusion.data import DiffusionRequestAbortedError
        from vllm_omni.diffusion.request import OmniDiffusionRequest
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        if self._engine is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        fed = isinstance(self._requests, PipelineRequests)  # fed by an upstream stage, not alone
        if handoff is not None and not fed:
            raise EngineError(f"stage {self.stage_name}: a lone DiT stage takes no upstream handoff")
        if handoff is None and fed:
            raise EngineError(f"stage {self.stage_name}: needs its upstream's handoff")
        assert self._requests is not None  # chosen in _launch, before the engine exists
        planned = self._requests.plan(request, handoff)
        rid = self.calls.mint(request.request_id)
        engine_request = OmniDiffusionRequest(
            prompt=planned.prompt, sampling_params=OmniDiffusionSamplingParams(**planned.sampling), request_id=rid
        )
        self._state[rid] = "waiting"
        finished: list[Any] = []
        with self.calls.track(request.request_id, rid) as call:
            try:
                async for output in self._engine_outputs(engine_request):
                    progress = self._progress(rid, output)
                    if progress is not None:
                        yield StageOutput(stage=self.stage_name, progress=progress)
                    elif output.finished:
                        call.finish()
                        finished = self._requests.outputs(output.images)
            except DiffusionRequestAbortedError:
                call.finish()  # aborted through abort(): nothing left to free
                yield StageOutput(stage=self.stage_name, finished=True, finish_reason=FinishReason.ABORT)
                return
            finally:
                self._state.pop(rid, None)
        yield await self._reply(planned, finished)

    def _progress(self, rid: str, output: Any) -> float | None:
        """What an engine output says of the call's progress: the steps done over the request's (a float from
        :meth:`_engine_outputs`), 0 when the scheduler admitted the request (the work started); None for a result."""
        from vllm_omni.diffusion.data import is_diffusion_request_started_output

        if isinstance(output, float):
            return output
        if is_diffusion_request_started_output(output):
            self._state[rid] = "running"
            return 0.0
        return None

    async def _reply(self, planned: Planned, outputs: list[Any]) -> StageOutput:
        """The stage's final output from the engine's finished outputs, by the stage's request mapping."""
        assert self._requests is not None
        if len(outputs) != planned.expected:
            raise EngineError(f"stage {self.stage_name}: expected {planned.expected} output(s), got {len(outputs)}")
        self._served += 1
        return await self._requests.reply(planned, outputs)

    async def _engine_outputs(self, engine_request: Any) -> AsyncIterator[Any]:
        """The engine's outputs for one request (each ``outputs[0]``), with its step progress between them.

        With ``step_execution`` the engine's step scheduler, on this process's engine thread, writes each
        finished step's index into the request's sampling params; it is read every ``PROGRESS_POLL_S``
        while the engine has not answered, and yielded (a float) when it moved. Without it nothing moves.
        """
        stream = self._engine.step_streaming(engine_request).__aiter__()
        params = engine_request.sampling_params
        total, reported = params.num_inference_steps or 0, 0
        pending = asyncio.ensure_future(anext(stream))
        try:
            while True:
                if self.args.step_execution and total:
                    done, _ = await asyncio.wait({pending}, timeout=PROGRESS_POLL_S)
                    step = min(params.step_index or 0, total)
                    if step > reported:
                        reported = step
                        yield step / total
                    if not done:
                        continue
                try:
                    outputs = await pending
                except StopAsyncIteration:
                    return
                yield outputs[0]
                pending = asyncio.ensure_future(anext(stream))
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await pending
            await stream.aclose()


FAMILY = Family(EngineArgs, create, input_modalities=input_modalities)
