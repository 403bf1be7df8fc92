"""What every vLLM-Omni stage kind shares: its EngineCore, the client, the output pump, one engine request.

The stage is built the way vLLM-Omni's ``StageRuntime`` builds each of its stages
(``_build_logical_stage_init_plans`` + ``_initialize_local_llm_replica``):

1. the stage config in vLLM-Omni's (legacy, production) per-stage shape, merged by vLLM-Omni from the
   stage's declaration and its deploy settings (:func:`~omni_serve.engines.vllm_omni.args.stage_config`);
2. ``stage_init_utils.build_engine_args_dict`` -> ``build_vllm_config`` -> ``(VllmConfig,
   executor class)``; the stage's worker (``ar``/``generation``) and scheduler classes come from
   its engine args;
3. ``stage_engine_startup.launch_stage_replica`` spawns the stage's EngineCore process
   (``StageEngineCoreProcManager``) and ``StageEngineCoreClientBase.make_async_mp_client``
   attaches the async client;
4. vLLM-Omni's ``MultimodalOutputProcessor`` turns engine outputs into ``RequestOutput``s with
   the stage's multimodal output (hidden states, codec codes, audio) attached; one background
   task pumps them, as vLLM's ``AsyncLLM`` does.

GPUs come from Ray (never ``devices``); tensor parallel runs inside the replica with the ``mp``
executor. ``vllm_omni`` is imported first (it patches vLLM): :func:`omni_serve.engines.vllm_omni.create`
reads the declaration before the engine is made.

What leaves a stage for its downstream stage is built by the stage's declared producer processors
(:class:`omni_serve.models.vllm_omni.edges.Producer`): :meth:`VllmOmniEngine.producer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

from omni_serve.engines.base import StageEngine
from omni_serve.engines.scheduler import SchedulerSnapshot
from omni_serve.engines.vllm_omni.args import EngineArgs, stage_config
from omni_serve.engines.vllm_omni.mapping import vllm_sampling_params
from omni_serve.exceptions import EngineDeadError, EngineError, InvalidStageInput
from omni_serve.models.vllm_omni import pipelines
from omni_serve.models.vllm_omni.edges import Producer, consumer_prompt
from omni_serve.payload import HandoffPayload
from omni_serve.types import StageRequest

logger = logging.getLogger("ray.serve")


async def _pump_outputs(client: Any, processor: Any, queues: dict[str, Any], scheduler: SchedulerSnapshot) -> None:
    """Engine outputs -> per-request collectors. Holds no engine reference (like AsyncLLM's handler)."""
    try:
        while True:
            outputs = await client.get_output_async()
            processed = processor.process_outputs(outputs.outputs, outputs.timestamp, None)
            for output in processed.request_outputs:  # outputs of requests registered without a queue
                queue = queues.get(output.request_id)
                if queue is not None:
                    queue.put(output)
            if processed.reqs_to_abort:
                await client.abort_requests_async(processed.reqs_to_abort)
            scheduler.record(outputs.scheduler_stats)
    except asyncio.CancelledError:
        raise
    except Exception as err:  # engine dead: every waiting request gets the error
        logger.exception("vllm_omni output pump failed")
        processor.propagate_error(err)
        for queue in queues.values():
            queue.put(err)
        raise


@functools.cache
def output_collector() -> type:
    """vLLM's per-request output collector, keeping the newest multimodal output when it merges outputs.

    A request's outputs queue up when its reader is slower than the engine (load), and vLLM's
    ``RequestOutput.add`` merges them: text and token ids, but not vLLM-Omni's multimodal output, so
    the merged output kept the older step's accumulation (a thinker's last rows, a talker's last codec
    frames lost; at the finish the consolidated tensors never arrive). vLLM-Omni accumulates the
    thinker's layers and the talker's codes per request, so the newest one holds everything. No
    upstream issue found.
    """
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.output_processor import RequestOutputCollector

    class Collector(RequestOutputCollector):
        def put(self, output: Any) -> None:
            held = self.output
            super().put(output)
            # Only where vLLM merged (``add``): a held error stays the request's outcome, and vLLM drops
            # an output put after it.
            if isinstance(held, RequestOutput) and isinstance(output, RequestOutput) and self.output is held:
                newest_multimodal(held, output)

    return Collector


def newest_multimodal(merged: Any, newer: Any) -> None:
    """``merged`` (an output ``newer`` was merged into) with ``newer``'s multimodal outputs."""
    if getattr(newer, "multimodal_output", None) is not None:
        merged.multimodal_output = newer.multimodal_output
    for completion in merged.outputs:
        for later in newer.outputs:
            if later.index == completion.index and getattr(later, "multimodal_output", None) is not None:
                completion.multimodal_output = later.multimodal_output


DEVICE_INIT_WAIT_S = 900  # how long a stage start waits for the others on its GPU (then starts anyway, warned)


@contextlib.contextmanager
def _device_init_lock(stage_id: int, engine_args: dict[str, Any]) -> Iterator[None]:
    """Hold vLLM-Omni's per-GPU start lock from the EngineCore's spawn until its handshake.

    vLLM sizes its KV cache from the GPU memory it sees free before and after a profiling run, so two
    engines starting on one GPU at once (stages with fractional ``num_gpus``) count each other's
    allocations as their own, or see memory freed mid-profile and fail its check. vLLM-Omni's
    ``StageRuntime`` starts co-located stages one at a time under these file locks (one per physical
    device, in /tmp); replicas on one node take the same ones, so native vLLM-Omni and omni_serve on
    one GPU wait for each other too. The devices are the replica's, as Ray set them
    (``CUDA_VISIBLE_DEVICES``). Only on GPUs: CPU engines size their cache from ``kv_cache_memory_bytes``.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        yield
        return
    from vllm_omni.engine.stage_init_utils import acquire_device_locks, release_device_locks

    fds = acquire_device_locks(stage_id, engine_args, DEVICE_INIT_WAIT_S)
    try:
        yield
    finally:
        release_device_locks(fds)


def _fail_into(task: asyncio.Task[None], queue: Any) -> None:
    """A failed input feed fails the engine request it feeds (its output collector raises it)."""
    if not task.cancelled() and task.exception() is not None:
        queue.put(task.exception())


class VllmOmniEngine(StageEngine):
    """One vLLM-Omni pipeline stage; a kind (:mod:`.autoregressive`, :mod:`.generation`) writes ``stream``."""

    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.args = EngineArgs.model_validate(engine_args)
        self.declared = pipelines.stage(self.args.pipeline, self.args.stage_id)  # its StagePipelineConfig
        self.pipeline_hooks = pipelines.hooks(self.args.pipeline)
        self.hooks = self.pipeline_hooks.stage(self.declared.model_stage)
        self.is_entry = not self.declared.input_sources
        self._client: Any = None
        self._processor: Any = None
        self._vllm_config: Any = None
        self._tokenizer: Any = None
        self._pump: asyncio.Task[None] | None = None
        self._scheduler = SchedulerSnapshot()
        self._queues: dict[str, Any] = {}  # engine request id -> its output collector
        self._generated = 0  # tokens (or codec steps) the engine produced, since start
        self._engine_output_type: str | None = None  # the merged config's (declared, or the graph's override)

    def check_declaration(self) -> None:
        """What the graph asks of this stage against what its pipeline declares (before anything starts):
        raises ``EngineError`` naming the setting."""
        where = f"stage {self.stage_name} (pipeline {self.args.pipeline} stage {self.args.stage_id})"
        if self.stream_input:
            upstream = [pipelines.stage(self.args.pipeline, i) for i in self.declared.input_sources]
            if len(upstream) != 1 or not upstream[0].async_chunk_process_next_stage_input_func:
                raise EngineError(f"{where}: stream_input: its upstream declares no async-chunk processor")
        if self.args.chunks is not None and not self.declared.async_chunk_process_next_stage_input_func:
            raise EngineError(f"{where}: engine_args.chunks: the stage declares no async-chunk processor")
        if not self.is_entry and (self.args.media or self.args.entry != "chat"):
            raise EngineError(f"{where}: engine_args.media / entry: only the entry stage takes a request's input")
        if self.args.media and not self.declared.requires_multimodal_data:
            raise EngineError(f"{where}: engine_args.media: the stage declares no multimodal input")
        text_out = bool(self.declared.final_output and self.declared.final_output_type == "text")
        if self.args.tool_call_parser is not None and not (self.is_entry and self.args.entry == "chat" and text_out):
            raise EngineError(
                f"{where}: engine_args.tool_call_parser: only a chat entry stage whose output is text parses tool calls"
            )

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        self.check_declaration()
        await asyncio.to_thread(self._launch)
        from vllm_omni.outputs.output_processor import MultimodalOutputProcessor

        model_config = self._vllm_config.model_config
        if not model_config.skip_tokenizer_init:
            from vllm.tokenizers import cached_tokenizer_from_config

            self._tokenizer = cached_tokenizer_from_config(model_config=model_config)
        self._processor = MultimodalOutputProcessor(
            tokenizer=self._tokenizer,
            log_stats=False,
            engine_core_output_type=self._engine_output_type,
        )
        self._pump = asyncio.create_task(_pump_outputs(self._client, self._processor, self._queues, self._scheduler))
        await self._setup(model_config.hf_config)

    async def _setup(self, hf_config: Any) -> None:
        """The kind's own start, once the engine runs; ``hf_config`` is the whole checkpoint's config."""

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` run on each of the stage's workers: what each returned (vLLM's collective RPC)."""
        return await self._client.collective_rpc_async(method, args=args, kwargs=kwargs)

    def producer(self) -> Producer:
        """What this stage hands its downstream stage, built by its declared processors."""
        return Producer(
            self.declared,
            self._vllm_config.model_config.hf_config,
            self.hooks,
            self.args.chunks,
            int(self._vllm_config.scheduler_config.max_num_seqs),
        )

    def _launch(self) -> None:
        """Build this stage's VllmConfig, spawn its EngineCore and attach the client (blocking; in a thread)."""
        from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClientBase
        from vllm_omni.engine.stage_engine_startup import launch_stage_replica
        from vllm_omni.engine.stage_init_utils import (
            build_engine_args_dict,
            build_vllm_config,
            extract_legacy_stage_metadata,
        )

        from omni_serve.checkpoints import resolve
        from omni_serve.platforms.executor import honour_uni

        model = resolve(self.args.model)  # a registered tiny checkpoint ("tiny": Qwen3-Omni's), built on first use
        cfg = stage_config(self.args, self.stream_input).to_omegaconf()
        self._engine_output_type = cfg.engine_args.get("engine_output_type")
        metadata = extract_legacy_stage_metadata(cfg)
        engine_args = build_engine_args_dict(cfg, model)
        vllm_config, executor_class = build_vllm_config(cfg, model, engine_args_dict=engine_args)
        if honour_uni(vllm_config, self.args.engine.get("distributed_executor_backend")):
            from vllm.v1.executor import Executor

            executor_class = Executor.get_class(vllm_config)
        if self.args.min_step_s:
            self._check_pacing(vllm_config)
            from omni_serve.platforms.quiet import quiet_executor

            executor_class = quiet_executor(executor_class)
        # The EngineCore's readiness handshake runs when launch_stage_replica's context exits, and the
        # client's constructor waits for a ready engine: the client must be made after leaving the
        # context, as vLLM-Omni's StageRuntime does (creating it inside deadlocks every stage start).
        # log_stats: the EngineCore then sends scheduler stats (running/waiting) with its outputs.
        with _device_init_lock(self.args.stage_id, engine_args):
            with launch_stage_replica(vllm_config, executor_class, True, self.args.stage_id, stage_config=cfg) as res:
                manager, coordinator, zmq = res.manager, res.coordinator, res.addresses
        addresses = {"input_address": zmq.inputs[0], "output_address": zmq.outputs[0]}
        if zmq.frontend_stats_publish_address is not None:
            addresses["stats_update_address"] = zmq.frontend_stats_publish_address
        try:
            self._client = StageEngineCoreClientBase.make_async_mp_client(
                vllm_config=vllm_config,
                executor_class=executor_class,
                log_stats=True,
                metadata=metadata,
                client_addresses=addresses,
                engine_manager=manager,
                coordinator=coordinator,
            )
        except BaseException:
            if manager is not None:  # the EngineCore process must not outlive a failed start
                manager.shutdown()
            raise
        self._vllm_config = vllm_config

    def _check_pacing(self, vllm_config: Any) -> None:
        """``min_step_s`` is honoured by omni_serve's CPU workers (the platform's); refuse it where they do not run."""
        from vllm.utils.import_utils import resolve_obj_by_qualname

        from omni_serve.pacing import configured_min_step
        from omni_serve.platforms.paced import PacedSteps

        worker = vllm_config.parallel_config.worker_cls
        if not issubclass(resolve_obj_by_qualname(worker), PacedSteps):
            raise EngineError(
                f"stage {self.stage_name}: engine_args.min_step_s: step pacing models an accelerator on a CPU "
                f"machine and runs in omni_serve's CPU platform workers; this stage's worker is {worker}"
            )
        if configured_min_step(vllm_config.additional_config) != self.args.min_step_s:  # stage_config() put it there
            raise EngineError(f"stage {self.stage_name}: vLLM-Omni dropped engine.additional_config (step pacing)")

    def shutdown(self) -> None:
        """Stop the output loop and the EngineCore process."""
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        if self._client is not None:
            client, self._client = self._client, None
            client.shutdown()

    # -- health, death, stats, abort (the ladder's hooks) ---------------------

    async def probe_health(self) -> None:
        if self._client is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        self._client.check_health()  # vLLM's EngineDeadError once the EngineCore process is gone
        if self._pump is not None and self._pump.done():  # no output can reach a request any more
            raise EngineDeadError(self.stage_name, "its output loop stopped")

    def dead_reason(self, err: BaseException) -> str | None:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        return "its EngineCore process died" if isinstance(err, VllmEngineDead) else None

    def invalid_input(self, err: BaseException) -> InvalidStageInput | None:
        from vllm.exceptions import VLLMValidationError

        if isinstance(err, VLLMValidationError):
            return InvalidStageInput(str(err), err.parameter)
        return None

    def stats(self) -> dict[str, Any]:
        """``running`` + ``waiting`` = ``in_flight``; ``aborted`` counts engine requests aborted,
        ``generated`` the tokens (codec steps for a talker) the engine produced since start;
        ``device`` and ``dtype``: where and in what the started EngineCore runs the model (its VllmConfig).

        ``in_flight`` is vLLM's own count of unfinished engine requests (its output processor drops
        a request only when it finishes or is aborted, so a request left running shows here); the
        split comes from the EngineCore's latest scheduler stats (:mod:`omni_serve.engines.scheduler`).
        """
        in_flight = self._processor.get_num_unfinished_requests() if self._processor is not None else 0
        placed: dict[str, str] = {}
        if self._vllm_config is not None:
            dtype = self._vllm_config.model_config.dtype
            placed = {"device": str(self._vllm_config.device_config.device_type), "dtype": str(dtype).split(".")[-1]}
        return {**self._scheduler.queue(in_flight), **self.calls.stats(), "generated": self._generated, **placed}

    async def _abort(self, handles: list[str]) -> None:
        if self._client is not None:
            ids = self._processor.abort_requests(handles, internal=False)
            await self._client.abort_requests_async(ids)

    # -- one engine request (the kinds' building block) ------------------------

    async def _request(
        self,
        request: StageRequest,
        prompt: dict[str, Any],
        params: Any,
        mm_features: Any = None,
        feed: Callable[[str], Coroutine[Any, Any, None]] | None = None,
    ) -> AsyncIterator[Any]:
        """One engine request for ``request``; yields ``RequestOutput``s until it finished.

        Its id is minted per engine request (vLLM-Omni treats a second request with a live id as a
        streaming update of the first) and tracked under the call's request id for abort. ``feed``
        (a streamed input) runs beside it with the engine request's id, until the request ends; if
        it fails, the request fails with its error (and is aborted, as any failed call is).
        """
        from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

        if self._client is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        model_config = self._vllm_config.model_config
        room = model_config.max_model_len - len(prompt["prompt_token_ids"])
        if room <= 0:
            raise InvalidStageInput(
                f"stage {self.stage_name}: prompt of {len(prompt['prompt_token_ids'])} tokens does not fit "
                f"max_model_len={model_config.max_model_len}"
            )
        if params.max_tokens is None or params.max_tokens > room:
            params.max_tokens = room
        # No '/' (graph call ids have them): vLLM-Omni's shared-memory connector names its segments after
        # the engine request id, and a POSIX shared-memory name is one path component.
        rid = self.calls.mint(request.request_id).replace("/", ":")
        core_request = build_engine_core_request_from_tokens(
            rid, prompt, params, model_config=model_config, mm_features=mm_features
        )
        core_request.external_req_id = rid
        queue = output_collector()(params.output_kind, rid)
        self._queues[rid] = queue
        feeding: asyncio.Task[None] | None = None
        with self.calls.track(request.request_id, rid) as call:
            try:
                self._processor.add_request(core_request, None, None, 0, queue)
                await self._client.add_request_async(core_request)
                if feed is not None:
                    feeding = asyncio.create_task(feed(rid))
                    feeding.add_done_callback(lambda task: _fail_into(task, queue))
                while not call.finished:
                    output = await queue.get()
                    if output.finished:
                        call.finish()
                    self._generated += len(output.outputs[0].token_ids)  # DELTA / FINAL_ONLY: counted once
                    yield output
            finally:
                self._queues.pop(rid, None)
                if feeding is not None:
                    feeding.cancel()
                    with contextlib.suppress(BaseException):
                        await feeding

    def _params(self, request: StageRequest, output_kind: str, sampling: Any = None, **overrides: Any) -> Any:
        """vLLM sampling params of one engine request: the call's sampling (or ``sampling``), ``overrides``, the
        stage's constraints (declared by the pipeline, with the graph's ``sampling_constraints`` over them).
        Structured outputs and logprobs are checked as vLLM's input processor checks them (which also picks the
        structured-output backend, missing otherwise: these requests skip that processor)."""
        from vllm.sampling_params import RequestOutputKind

        sampling = sampling if sampling is not None else request.sampling
        sampling = sampling.model_copy(update=overrides) if overrides else sampling
        constraints = {**self.declared.sampling_constraints, **self.args.sampling_constraints}
        params = vllm_sampling_params(sampling, constraints, RequestOutputKind[output_kind])
        if params.structured_outputs is not None or params.logprobs is not None:
            config = self._vllm_config
            params.verify(
                config.model_config, config.speculative_config, config.structured_outputs_config, self._tokenizer
            )
        return params

    def _handoff_in(self, handoff: HandoffPayload | None) -> HandoffPayload:
        """A downstream stage's input: its upstream stage's handoff, which it cannot run without."""
        if handoff is None:
            raise InvalidStageInput(f"stage {self.stage_name}: needs a handoff from its upstream stage")
        return handoff

    def _consumer_prompt(self, request: StageRequest, handoff: HandoffPayload | None, **options: Any) -> Any:
        """A downstream stage's prompt from its upstream stages' handoffs (several where it declares a fan-in),
        built by the pipeline's own input processor for this edge."""
        sources = request.handoffs if request.handoffs is not None else [self._handoff_in(handoff)]
        try:
            return consumer_prompt(
                self.declared,
                sources,
                upstream=[pipelines.stage(self.args.pipeline, i) for i in self.declared.input_sources],
                request_id=request.request_id,
                hf_config=self._vllm_config.model_config.hf_config,
                model_config=self._vllm_config.model_config,
                **options,
            )
        except ValueError as err:
            raise InvalidStageInput(f"stage {self.stage_name}: {err}") from None
