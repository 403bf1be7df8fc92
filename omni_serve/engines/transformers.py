"""The ``transformers`` engine family: Qwen3-Omni stages run by Hugging Face transformers.

One engine serves one stage (thinker, talker or code2wav) of a Qwen3-Omni checkpoint;
``model: tiny`` is the random-weight checkpoint of :mod:`omni_serve.checkpoints.tiny_omni`. It runs
anywhere (CPU included) and is the reference the faster engine families are compared with.

Concurrency: each engine runs its model work on one dedicated worker thread, one request
at a time, in arrival order. HF ``generate`` samples from torch's global RNG, so a request
seeds it when its turn comes, and sampling stages of one process share one lock: a
request's draws are a function of its seed alone, whatever else runs. Results travel back
to the event loop with ``call_soon_threadsafe``; the consumer merges whatever has piled up
into one output. torch/transformers are imported in ``start()``, so importing this module
is cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.engines.base import StageEngine, engine_for_role
from omni_serve.engines.grammar import GrammarCompiler, grammar_available, grammar_processor
from omni_serve.engines.logprobs import LogprobRecorder
from omni_serve.models import qwen3_omni
from omni_serve.models.tool_calls import (
    ParserLoader,
    ToolCallStream,
    merge_deltas,
    parser_or_refuse,
    tool_call_parser_field,
)
from omni_serve.pacing import StepPacer, min_step_field
from omni_serve.payload import HandoffPayload
from omni_serve.types import (
    EngineDeadError,
    EngineError,
    FinishReason,
    InvalidStageInput,
    Modality,
    RequestId,
    SamplingParams,
    StageOutput,
    StageRequest,
    TextPart,
    ToolCallDelta,
    Usage,
)

logger = logging.getLogger(__name__)

# Sampling stages in one process (in-process tests, a co-located graph) take turns on the
# global torch RNG; in a deployment each replica has one engine and never waits here.
_RNG_LOCK = threading.Lock()


class TransformersEngineArgs(BaseModel):
    """``engine_args`` of a ``transformers`` stage."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field("tiny", description="Checkpoint path or hub-style name; 'tiny' builds the tiny random one.")
    model_stage: Literal["thinker", "talker", "code2wav"] = Field(description="The Qwen3-Omni stage this engine runs.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights and activations dtype.")
    num_threads: int = Field(1, ge=1, description="torch intra-op threads of the replica (torch.set_num_threads).")
    default_voice: str = Field("ethan", description="Talker voice when the request names none.")
    codec_first_chunk_frames: int = Field(
        25, ge=1, description="Codec frames in the talker's first chunk (smaller: earlier first audio)."
    )
    codec_chunk_frames: int = Field(25, ge=1, description="Codec frames in each later talker chunk.")
    codec_left_context_frames: int = Field(
        25, ge=0, description="Frames before each chunk it carries for code2wav's context (>= 1 keeps joins seamless)."
    )
    min_step_s: float = min_step_field()  # omni_serve.pacing
    tool_call_parser: str | None = tool_call_parser_field()
    mm_processor_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Thinker: keyword arguments for every call of the checkpoint's processor on media (as vLLM's "
        "engine arg of that name), e.g. a video size for a checkpoint whose processor defaults do not fit.",
    )

    @model_validator(mode="after")
    def _tools_on_the_thinker(self) -> TransformersEngineArgs:
        if self.tool_call_parser is not None and self.model_stage != "thinker":
            raise ValueError("tool_call_parser: only the thinker parses tool calls from its output")
        return self


EngineArgs = TransformersEngineArgs  # the name omni_serve.engines looks up in every family


def input_modalities(args: TransformersEngineArgs) -> set[Modality]:
    """The thinker takes images, audio and video through Qwen3-Omni's encoders; the other stages take no chat."""
    return {Modality.TEXT, Modality.IMAGE, Modality.AUDIO, Modality.VIDEO} if args.model_stage == "thinker" else set()


def reads_streamed_input(engine_args: dict[str, Any]) -> bool:
    """The talker reads its thinker's handoff as a stream (``stream_input``); code2wav decodes one chunk a call."""
    return engine_args.get("model_stage") == "talker"


def honoured_sampling(engine_args: dict[str, Any]) -> frozenset[str]:
    """The thinker maps ``ignore_eos``, ``min_p``, ``skip_special_tokens`` and ``logit_bias`` onto HF ``generate``,
    reports ``logprobs`` (:mod:`omni_serve.engines.logprobs`) and, where xgrammar is installed (it comes with
    vLLM), honours ``structured_outputs`` (:mod:`omni_serve.engines.grammar`); the talker ``ignore_eos`` (its
    codec EOS); the talker and code2wav produce no text, so the two parameters that only shape text change
    nothing there."""
    stage = engine_args.get("model_stage")
    if stage == "thinker":
        grammar = {"structured_outputs"} if grammar_available() else set()
        return frozenset({"ignore_eos", "min_p", "skip_special_tokens", "logit_bias", "logprobs", *grammar})
    text_only = {"skip_special_tokens", "spaces_between_special_tokens"}
    return frozenset(text_only | {"ignore_eos"} if stage == "talker" else text_only)


def create(stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    """The engine for ``engine_args['model_stage']``; raises ``pydantic.ValidationError`` on bad args."""
    args = TransformersEngineArgs.model_validate(engine_args)
    roles = {"thinker": ThinkerEngine, "talker": TalkerEngine, "code2wav": Code2WavEngine}
    return engine_for_role(roles, args.model_stage, stage_name, engine_args)


# --- plumbing ------------------------------------------------------------------------------


class _Worker:
    """One daemon thread running submitted callables in order."""

    def __init__(self, name: str):
        self._jobs: SimpleQueue[tuple[Callable[[], Any], Future] | None] = SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the awaiting side
                fut.set_exception(exc)


@dataclass
class _Failure:
    exc: BaseException


_END = object()
Emit = Callable[[Any], None]
# Outputs a job may have emitted that its stage has not taken; then it waits (and holds the worker,
# as a streamed talker waiting for its thinker's rows does): a talker at most this many codec chunks
# ahead of its stage, a thinker this many tokens.
MAX_UNTAKEN_OUTPUTS = 8


class _HFEngine(StageEngine):
    """Loading, the worker thread and stats shared by the three stages; a call's job is tracked in
    ``self.calls`` by its cancel event, which the job's stopping criteria poll (abort sets it)."""

    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.args = TransformersEngineArgs.model_validate(engine_args)
        self._worker: _Worker | None = None
        self._ready = False
        self._counts_lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._total = 0
        self._emitted = 0  # outputs its jobs emitted (tests: a job held back by its reader stops emitting)

    async def start(self) -> None:
        self._worker = _Worker(f"{self.stage_name}-engine")
        t0 = time.perf_counter()
        await asyncio.wrap_future(self._worker.submit(self._load))
        self._ready = True
        logger.info(
            "stage %s: transformers engine (%s, model %s, %s, %d threads) ready in %.1f s",
            self.stage_name,
            self.args.model_stage,
            self.args.model,
            self.args.dtype,
            self.args.num_threads,
            time.perf_counter() - t0,
        )

    def _load(self) -> None:
        import torch
        from transformers import Qwen3OmniMoeForConditionalGeneration

        from omni_serve.checkpoints.tiny_omni import resolve_model

        torch.set_num_threads(self.args.num_threads)
        self.model_path = resolve_model(self.args.model)
        # The whole checkpoint is loaded and the other stages dropped: loading a sub-model class
        # directly mis-converts the talker's MoE expert weights in transformers 5.14. The thinker
        # skips building talker and code2wav.
        thinker_only = self.args.model_stage == "thinker"
        load_log = logging.getLogger("transformers.modeling_utils")
        quiet = _DropLoadReport()
        if thinker_only:  # its load report would list every talker/code2wav weight as "unexpected"
            load_log.addFilter(quiet)
        try:
            model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
                self.model_path, dtype=getattr(torch, self.args.dtype), enable_audio_output=not thinker_only
            ).eval()
        finally:
            load_log.removeFilter(quiet)
        self.config = model.config
        self._setup(model)

    def _setup(self, model: Any) -> None:
        raise NotImplementedError

    async def _abort(self, handles: list[threading.Event]) -> None:
        for cancelled in handles:
            cancelled.set()

    async def probe_health(self) -> None:
        self._check_worker()

    def _check_worker(self) -> _Worker:
        """The worker thread, once started and while alive."""
        if not self._ready or self._worker is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        if not self._worker.alive():
            raise EngineDeadError(self.stage_name, "its worker thread died")
        return self._worker

    def stats(self) -> dict[str, Any]:
        with self._counts_lock:
            return {
                "running": self._running,
                "waiting": self._waiting,
                "requests_total": self._total,
                "emitted": self._emitted,
                **self.calls.stats(),
            }

    async def _run(
        self, request_id: RequestId, job: Callable[[Emit, threading.Event], None]
    ) -> AsyncGenerator[list[Any], None]:
        """Run ``job(emit, cancelled)`` on the worker thread; yield what it emits, in batches.

        ``cancelled`` is the job's handle in ``self.calls``: an abort of ``request_id`` (the ladder's,
        when the caller leaves early) sets it, and the job's stopping criteria poll it between steps.
        A job's failure is raised here as it was raised on the worker thread.
        """
        worker = self._check_worker()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        # The job waits while MAX_UNTAKEN_OUTPUTS of its outputs are not taken yet: a caller that stops
        # reading (omni_serve.graph.flow) stops the job too, instead of letting it fill this queue.
        room = threading.Semaphore(MAX_UNTAKEN_OUTPUTS)

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody will read this
                cancelled.set()

        def emit(item: Any) -> None:
            while not room.acquire(timeout=0.05):  # polls the abort flag meanwhile
                if cancelled.is_set():
                    return  # aborted: nobody takes it
            with self._counts_lock:
                self._emitted += 1
            put(item)

        def run() -> None:
            with self._counts_lock:
                self._waiting -= 1
                self._running += 1
            last: Any = _END
            try:
                if not cancelled.is_set():
                    job(emit, cancelled)
            except BaseException as exc:
                last = _Failure(exc)
            finally:
                with self._counts_lock:  # before the end marker: the caller may read stats right after
                    self._running -= 1
            put(last)  # never waits: the end is always taken

        with self._counts_lock:
            self._waiting += 1
            self._total += 1
        with self.calls.track(request_id, cancelled) as call:
            worker.submit(run)
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                if batch[-1] is _END or isinstance(batch[-1], _Failure):
                    call.finish()  # the job is over: nothing left to abort
                items = batch[:-1] if batch[-1] is _END else batch
                for item in items:
                    if isinstance(item, _Failure):
                        raise item.exc
                if items:
                    yield items
                    for _ in items:  # taken: the job may emit as many more
                        room.release()
                if call.finished:
                    return


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def _seed(sampling: SamplingParams) -> int:
    return sampling.seed if sampling.seed is not None else secrets.randbits(63)


def _generation_config(s: SamplingParams, **fields: Any) -> Any:
    """One call's ``GenerationConfig``: ``s`` (:func:`_sampling_kwargs`) and ``fields``.

    Passed to ``generate`` as ``generation_config`` rather than as keyword arguments: given none,
    transformers 5.14.1's ``_prepare_generation_config`` first checks the model config for stray
    generation settings (``PreTrainedConfig._get_generation_parameters``) by building a default
    instance of the whole config class, 4.7 ms per call for the thinker and 3.8 ms for the talker
    on the CPU box, spent before the first token. The resulting settings are the same: the
    checkpoint's ``generation_config`` still fills what is left unset.
    """
    from transformers import GenerationConfig

    return GenerationConfig(**_sampling_kwargs(s), **fields)


def _sampling_kwargs(s: SamplingParams) -> dict[str, Any]:
    """HF ``generate`` settings for ``s``.

    ``top_k`` 1 keeps only the most likely token whatever the temperature, top-p or min-p, so it
    decodes greedily: the same tokens without HF's sampling path, which sorts (top-p) and draws
    (multinomial) over the whole vocabulary at every step (half the tiny thinker's CPU with its
    152k-token vocabulary, measured with py-spy).
    """
    sample = s.temperature > 0 and s.top_k != 1
    kwargs: dict[str, Any] = {"do_sample": sample}
    if s.repetition_penalty != 1.0:  # 1.0 is HF's no-op; passing it only draws a warning with inputs_embeds
        kwargs["repetition_penalty"] = s.repetition_penalty
    if s.logit_bias:  # OpenAI's logit_bias is HF's bias of one-token sequences, added to the logits before sampling
        kwargs["sequence_bias"] = {(int(token),): float(bias) for token, bias in s.logit_bias.items()}
    if sample:
        kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)  # top_k 0: HF adds no filter
        if s.min_p > 0:
            kwargs["min_p"] = s.min_p
    return kwargs


def end_ids(eos_ids: list[int], stop_token_ids: set[int], ignore_eos: bool) -> list[int]:
    """The token ids that end a generation: the model's EOS tokens unless ``ignore_eos``, and the stop ids.

    An empty list (``ignore_eos`` without stop ids) overrides the checkpoint's generation config, so
    ``generate`` then runs to ``max_new_tokens``.
    """
    return sorted(stop_token_ids if ignore_eos else set(eos_ids) | stop_token_ids)


def _stopping(
    cancelled: threading.Event,
    min_step_s: float,
    extra: Callable[[], bool] | None = None,
    before_next: Callable[[], None] | None = None,
) -> Any:
    """HF stopping criteria, run after every decoding step: paced (``min_step_s``), then stop on abort or
    ``extra``; ``before_next`` waits for what the next step needs (the next step's time counts from then)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    pacer = StepPacer(min_step_s, cancelled)

    class _Flag(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            import torch

            pacer.step_done()
            if before_next is not None:
                before_next()
                pacer.step_started()
            stop = cancelled.is_set() or (extra is not None and extra())
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Flag()])


# --- thinker -------------------------------------------------------------------------------


class _TextStream:
    """Incremental detokenization with stop strings, fed one generated token at a time.

    Emitted text never changes afterwards: trailing U+FFFD (a UTF-8 sequence still being
    completed by the next byte tokens) and the last ``len(longest stop) - 1`` characters
    (a stop string may be forming) are held back until ``finish``.
    """

    def __init__(self, tokenizer: Any, stop: list[str], stop_token_ids: set[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._stop_ids = stop_token_ids
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text_ids: list[int] = []
        self._text_len: list[int] = []  # len(_text_ids) after each generated token
        self.text = ""
        self.emitted = 0
        self.stop_at: int | None = None  # char offset of the matched stop string

    def add(self, token_id: int) -> str:
        if self.stop_at is not None:
            return ""
        if token_id not in self._stop_ids:  # a stop token ends the text without showing in it
            self._text_ids.append(token_id)
        self._text_len.append(len(self._text_ids))
        text = self._tok.decode(self._text_ids, skip_special_tokens=self._skip_special)
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stop_at = min(hits)
            self.text = text[: self.stop_at]
            return self._emit(len(self.text))
        self.text = text
        end = len(text) - self._hold
        while end > self.emitted and text[end - 1] == "\ufffd":
            end -= 1
        return self._emit(end)

    def finish(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def tokens_before_stop(self) -> int:
        """How many generated tokens lie wholly before the stop string (all of them if none matched)."""
        k = len(self._text_len)
        if self.stop_at is None:
            return k
        while k > 0 and len(self._decode_first(self._text_len[k - 1])) > self.stop_at:
            k -= 1
        return k

    def _decode_first(self, n: int) -> str:
        return self._tok.decode(self._text_ids[:n], skip_special_tokens=self._skip_special)


class ThinkerEngine(_HFEngine):
    """Chat messages -> streamed text, then the thinker2talker handoff."""

    def _setup(self, model: Any) -> None:
        import torch
        from transformers import AutoTokenizer

        self.thinker = model.thinker
        # generate() samples from the last position's logits only, but the thinker's forward has no
        # `logits_to_keep` (transformers 5.14.1; the argument generate() passes to models that take it,
        # huggingface/transformers#31292), so its prefill projects every prompt position onto the
        # 152k-token vocabulary: 31 of the 36 ms of a 64-token prefill of the tiny thinker, all of it
        # before the first token. The head sees only the last position instead (its hidden states,
        # which the talker gets, are untouched; decoding steps have one position anyway).
        self.thinker.lm_head.register_forward_pre_hook(lambda _head, args: (args[0][:, -1:],))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        cfg = self.config
        self.context_len = int(cfg.thinker_config.text_config.max_position_embeddings)
        self.eos_ids = sorted(
            {
                i
                for i in (self.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
                if isinstance(i, int) and i >= 0
            }
        )
        tc = cfg.thinker_config
        self.reserved_ids = {
            tc.audio_token_id,
            tc.image_token_id,
            tc.video_token_id,
            tc.audio_start_token_id,
            getattr(tc, "vision_start_token_id", -1),
        }
        self.accept_layer = int(cfg.talker_config.accept_hidden_layer)
        self.grammars = GrammarCompiler(self.tokenizer, int(self.thinker.lm_head.out_features))
        name = self.args.tool_call_parser
        self.tool_parser = ParserLoader(name) if name else None  # vLLM's parser, loaded on first use
        with torch.inference_mode():
            tts_ids = torch.tensor([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])
            self.tts_embeds = self.thinker.get_input_embeddings()(tts_ids.to(self.thinker.device))
        # The checkpoint's processor (feature extractor, image and video processors) turns media into
        # encoder inputs and expands their placeholders. Its image/video processors need torchvision;
        # without it the thinker still serves text and refuses media with a 500 naming the cause.
        self.processor: Any = None
        self.processor_error = ""
        try:
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(self.model_path)
            self.audio_input_rate = int(self.processor.feature_extractor.sampling_rate)
        except Exception as err:
            self.processor_error = f"{type(err).__name__}: {err}"
            logger.warning("stage %s: no media input, the processor did not load (%s)", self.stage_name, err)

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        if not request.messages:
            raise InvalidStageInput(f"stage {self.stage_name}: the thinker needs chat messages", "messages")
        calls = await self._tool_calls(request)

        def job(emit: Emit, cancelled: threading.Event) -> None:
            self._generate(request, calls, emit, cancelled)

        async with contextlib.aclosing(self._run(request.request_id, job)) as batches:
            async for batch in batches:
                deltas = [item for item in batch if item[0] == "delta"]
                text = "".join(item[1] for item in deltas)
                token_ids = [t for item in deltas for t in item[2]]
                logprobs = [item[4] for item in deltas if item[4] is not None] or None
                tool_calls: list[ToolCallDelta] = []
                for item in deltas:
                    tool_calls = merge_deltas(tool_calls, item[5])
                prompt = next((item[1] for item in batch if item[0] == "prompt"), None)
                final = next((item for item in batch if item[0] == "final"), None)
                # Streamed handoff: the rows this batch's steps ran, one chunk per output.
                chunks = [item[1] for item in batch if item[0] == "rows"]
                chunk = qwen3_omni.merge_thinker_chunks(chunks) if chunks else None
                if final is None:
                    usage = next(
                        (item[3] if item[0] == "delta" else item[2] for item in reversed(batch) if item[0] != "final"),
                        None,
                    )
                    yield StageOutput(
                        stage=self.stage_name,
                        text=text,
                        token_ids=token_ids,
                        prompt_text=prompt,
                        usage=usage,
                        handoff=chunk,
                        logprobs=logprobs,
                        tool_calls=tool_calls,
                    )
                else:
                    _, tail, reason, usage, payload, tail_calls = final
                    payload = payload if payload is not None else chunk
                    yield StageOutput(
                        stage=self.stage_name,
                        text=text + tail,
                        token_ids=token_ids,
                        finished=True,
                        finish_reason=reason,
                        usage=usage,
                        handoff=payload,
                        prompt_text=prompt,
                        logprobs=logprobs,
                        tool_calls=merge_deltas(tool_calls, tail_calls),
                    )

    async def _tool_calls(self, request: StageRequest) -> ToolCallStream | None:
        """The request's tool-call parsing (None without tools, or with ``tool_choice: none``); waits for the
        parser still loading (:class:`ParserLoader`)."""
        tools = request.tools
        if tools is None or tools.choice == "none":
            return None
        loaded: Any = None
        if self.tool_parser is not None:
            try:
                loaded = await asyncio.wrap_future(self.tool_parser.future())
            except Exception as err:
                loaded = err
        parser = parser_or_refuse(loaded, self.stage_name, self.args.tool_call_parser)
        return ToolCallStream(parser, self.tokenizer, tools)

    def merge_handoffs(self, first: HandoffPayload, later: HandoffPayload) -> HandoffPayload:
        return qwen3_omni.merge_thinker_chunks([first, later])

    def _prompt(self, request: StageRequest) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """Prompt ids [1, T]; with media also the processor's encoder inputs for ``generate`` and
        what the talker's RoPE needs of them (:func:`qwen3_omni.rope_inputs`)."""
        field = "input" if request.reply is not None else "messages"
        for message in request.messages or []:  # the template adds no reserved token; the text must not either
            parts = [message.content] if isinstance(message.content, str) else message.content
            for text in (p if isinstance(p, str) else p.text for p in parts if isinstance(p, str | TextPart)):
                if self.reserved_ids.intersection(self.tokenizer.encode(text, add_special_tokens=False)):
                    raise InvalidStageInput("messages: the prompt contains reserved multimodal tokens", field)
        turns = qwen3_omni.template_messages(request.messages or [])
        tools = request.tools.tools if request.tools else None
        try:
            text = self.tokenizer.apply_chat_template(turns, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # jinja2 raises TemplateError for conversations the template refuses
            raise InvalidStageInput(f"messages: the model's chat template refused them: {err}", field) from None
        if not request.media:
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            return ids.to(self.thinker.device), {}, {}
        if self.processor is None:
            raise EngineError(f"stage {self.stage_name}: cannot take media input ({self.processor_error})")
        media = qwen3_omni.processor_media(request.media)
        inputs = self.processor(text=text, return_tensors="pt", **{**self.args.mm_processor_kwargs, **media})
        inputs = dict(inputs.to(self.thinker.device, dtype=self.thinker.dtype))
        inputs.pop("attention_mask", None)
        ids = inputs.pop("input_ids")
        generate_inputs = {**inputs, "use_audio_in_video": bool(media.get("use_audio_in_video"))}
        return ids, generate_inputs, qwen3_omni.rope_inputs(inputs)

    def _generate(
        self, request: StageRequest, calls: ToolCallStream | None, emit: Emit, cancelled: threading.Event
    ) -> None:
        import torch
        from transformers import LogitsProcessorList
        from transformers.generation.streamers import BaseStreamer

        input_ids, media_inputs, rope = self._prompt(request)
        prompt_len = int(input_ids.shape[1])
        if prompt_len >= self.context_len:
            raise InvalidStageInput(
                f"messages: the prompt has {prompt_len} tokens; the model's context is "
                f"{self.context_len} tokens and generation needs at least one more",
                "input" if request.reply is not None else "messages",
            )
        # Every item but the final carries the usage so far (the final, the total).
        if request.return_prompt_text:
            emit(("prompt", self.tokenizer.decode(input_ids[0], skip_special_tokens=False), Usage(prompt_len)))

        if request.reply is not None:
            self._speak(request, input_ids, emit)
            return

        s = calls.constrained(request.sampling) if calls is not None else request.sampling
        vocab = int(self.thinker.lm_head.out_features)
        outside = sorted(t for t in s.logit_bias or {} if not 0 <= t < vocab)
        if outside:
            raise InvalidStageInput(f"logit_bias: token id {outside[0]} is not in the model's vocabulary", "logit_bias")
        stop_ids = set(s.stop_token_ids)
        eos = end_ids(self.eos_ids, stop_ids, s.ignore_eos)
        # The tokens that end the generation never show in the text (as in vLLM), special or not.
        text = _TextStream(self.tokenizer, s.stop, set(eos), s.skip_special_tokens)
        generated: list[int] = []
        processors = LogitsProcessorList()
        if s.structured_outputs is not None:
            processors.append(self._grammar(s, calls, end_ids(self.eos_ids, stop_ids, False)))
        recorder = LogprobRecorder(self.thinker.lm_head, self.tokenizer, s.logprobs) if s.logprobs is not None else None

        def so_far() -> Usage:
            return Usage(prompt_tokens=prompt_len, completion_tokens=len(generated))

        class _Streamer(BaseStreamer):
            first = True

            def put(self, value: Any) -> None:
                if self.first:  # generate() first hands the streamer the prompt
                    self.first = False
                    return
                token = int(value.reshape(-1)[0])
                generated.append(token)
                piece, found = text.add(token), list[ToolCallDelta]()
                if calls is not None:  # the client gets the reply without its calls, the calls apart
                    piece, found = calls.push(piece, [token], False)
                logprob = recorder.token(token) if recorder is not None else None
                emit(("delta", piece, [token], so_far(), logprob, found))

            def end(self) -> None:
                pass

        # Streamed handoff: each forward's rows go out as they are computed (the prompt's with the
        # prefill, then one reply position per step), those of tool calls never (_RowGate). Stop strings
        # can take back tokens already run, so a request with stop strings hands its rows over whole at the end.
        streamed = request.wants_handoff and request.stream_handoff and not s.stop
        gate = _RowGate(calls, emit, so_far) if streamed else None
        hook = self.thinker.register_forward_hook(self._rows_sender(input_ids, rope, gate)) if gate else None
        try:
            with _RNG_LOCK, torch.inference_mode():
                torch.manual_seed(_seed(s))
                out = self.thinker.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    **media_inputs,
                    generation_config=_generation_config(
                        s,
                        max_new_tokens=min(s.max_tokens, self.context_len - prompt_len),
                        eos_token_id=eos,
                        pad_token_id=self.tokenizer.pad_token_id,
                        output_hidden_states=request.wants_handoff,  # text-only requests skip the hidden states
                        return_dict_in_generate=True,
                    ),
                    logits_processor=processors,
                    streamer=_Streamer(),
                    stopping_criteria=_stopping(cancelled, self.args.min_step_s, lambda: text.stop_at is not None),
                )
        finally:
            if hook is not None:
                hook.remove()
            if recorder is not None:
                recorder.close()

        if text.stop_at is not None:
            reason = FinishReason.STOP
        elif cancelled.is_set():
            reason = FinishReason.ABORT
        elif generated and generated[-1] in eos:
            reason = FinishReason.STOP
        else:
            reason = FinishReason.LENGTH
        tail, tail_calls = text.finish(), list[ToolCallDelta]()
        kept = text.tokens_before_stop()
        if calls is not None:
            tail, tail_calls = calls.push(tail, [], True)
            reason = calls.finish_reason(reason)
            kept = min(kept, calls.spoken)  # the talker speaks only the text the client sees
        if gate is not None:
            gate.release()  # rows the last text confirmed
        whole = request.wants_handoff and not streamed
        payload = self._handoff(out, prompt_len, kept, rope) if whole else None
        emit(("final", tail, reason, so_far(), payload, tail_calls))

    def _grammar(self, s: SamplingParams, calls: ToolCallStream | None, ends: list[int]) -> Any:
        """The logits processor of ``s.structured_outputs``: a forced tool call's, or the client's constraint."""
        forced = calls is not None and calls.request.structured_outputs is not None
        param = "tool_choice" if forced else "response_format"
        if not grammar_available():
            raise InvalidStageInput(
                f"{param}: stage '{self.stage_name}' constrains its output with xgrammar, which is not installed "
                "(it comes with vLLM)",
                param,
            )
        assert s.structured_outputs is not None
        return grammar_processor(self.grammars.compile(s.structured_outputs, param), ends)

    def _rows_sender(self, input_ids: Any, rope: dict[str, Any], gate: _RowGate) -> Callable[..., None]:
        """A forward hook on the thinker that hands each forward's rows to ``gate``: the prompt's payload with
        the prefill, then one reply position's rows chunk per decoding step."""
        prompt_len = int(input_ids.shape[1])
        first = True

        def send(module: Any, args: Any, output: Any) -> None:
            nonlocal first
            states = output.hidden_states
            embeds, hidden = states[0][0], states[self.accept_layer][0]
            if first:
                first = False
                gate.prompt(
                    qwen3_omni.build_thinker2talker(
                        token_ids=input_ids[0].tolist(),
                        prompt_len=prompt_len,
                        embeds=embeds,
                        hidden=hidden,
                        tts_embeds=self.tts_embeds,
                        accept_hidden_layer=self.accept_layer,
                        rope=rope,
                        streamed=True,
                    )
                )
            else:
                gate.reply(qwen3_omni.thinker_rows_chunk(embeds, hidden))

        return send

    def _speak(self, request: StageRequest, input_ids: Any, emit: Emit) -> None:
        """Teacher-force ``request.reply`` as the assistant turn: what generate() would have produced
        had it sampled exactly these tokens, then <|im_end|> (whose own hidden state, as in
        generate(), is never computed)."""
        import torch

        reply = self.tokenizer.encode(request.reply or "", add_special_tokens=False)
        if not reply:
            raise InvalidStageInput("input: the text to speak is empty", "input")
        prompt_len = int(input_ids.shape[1])
        if prompt_len + len(reply) >= self.context_len:
            raise InvalidStageInput(
                f"input: {len(reply)} tokens to speak do not fit the model's context of {self.context_len} tokens",
                "input",
            )
        usage = Usage(prompt_tokens=prompt_len, completion_tokens=len(reply) + 1)
        if not request.wants_handoff:  # nothing downstream: the hidden states of the reply are not needed
            emit(("final", request.reply, FinishReason.STOP, usage, None, []))
            return
        sequence = torch.cat([input_ids, torch.tensor([reply], dtype=input_ids.dtype, device=input_ids.device)], 1)
        with torch.inference_mode():
            out = self.thinker(input_ids=sequence, attention_mask=torch.ones_like(sequence), output_hidden_states=True)
        steps = (out.hidden_states,)  # one "step" covering every position, like generate()'s prefill
        token_ids = [*sequence[0].tolist(), self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        payload = qwen3_omni.build_thinker2talker(
            token_ids=token_ids,
            prompt_len=prompt_len,
            embeds=qwen3_omni.thinker_states(steps, 0),
            hidden=qwen3_omni.thinker_states(steps, self.accept_layer),
            tts_embeds=self.tts_embeds,
            accept_hidden_layer=self.accept_layer,
        )
        emit(("final", request.reply, FinishReason.STOP, usage, payload, []))

    def _handoff(self, out: Any, prompt_len: int, kept: int, rope: dict[str, Any]) -> HandoffPayload:
        # The talker speaks only what the client sees: tokens from a stop string on are dropped.
        rows = min(prompt_len + kept, sum(step[0].shape[1] for step in out.hidden_states))
        return qwen3_omni.build_thinker2talker(
            token_ids=out.sequences[0, : prompt_len + kept].tolist(),
            prompt_len=prompt_len,
            embeds=qwen3_omni.thinker_states(out.hidden_states, 0)[:rows],
            hidden=qwen3_omni.thinker_states(out.hidden_states, self.accept_layer)[:rows],
            tts_embeds=self.tts_embeds,
            accept_hidden_layer=self.accept_layer,
            rope=rope,
        )


class _RowGate:
    """The thinker's streamed rows on their way to the talker: a reply row goes once its token is spoken.

    The prompt's rows go at once. Reply row ``r`` is generated token ``r``'s; with tool calling it goes
    only once :attr:`ToolCallStream.spoken` covers that token, so the talker never gets a tool call's
    rows, nor text that may still turn out to open one (a parser holding back a partial tag); rows
    never confirmed are dropped at the end. Without tool calling every row goes as it is computed.
    """

    def __init__(self, calls: ToolCallStream | None, emit: Emit, usage: Callable[[], Usage]):
        self.calls = calls
        self.emit = emit
        self.usage = usage
        self.held: list[HandoffPayload] = []  # reply rows chunks not sent yet, in order
        self.sent = 0  # reply rows sent

    def prompt(self, payload: HandoffPayload) -> None:
        self.emit(("rows", payload, self.usage()))

    def reply(self, chunk: HandoffPayload) -> None:
        self.held.append(chunk)
        self.release()

    def release(self) -> None:
        """Send the held rows of the tokens spoken by now."""
        ready: list[HandoffPayload] = []
        while self.held and (self.calls is None or self.sent + _rows(self.held[0]) <= self.calls.spoken):
            chunk = self.held.pop(0)
            self.sent += _rows(chunk)
            ready.append(chunk)
        if ready:
            self.emit(("rows", qwen3_omni.merge_thinker_chunks(ready), self.usage()))


def _rows(chunk: HandoffPayload) -> int:
    return int(chunk.tensors["embeds"].shape[0])


# --- talker --------------------------------------------------------------------------------


class TalkerEngine(_HFEngine):
    """thinker2talker handoff -> codec chunks, streamed as the frames are generated."""

    def _setup(self, model: Any) -> None:
        qwen3_omni.give_talker_the_audio_config(model)
        self.talker = model.talker
        self.suppress_tokens = qwen3_omni.talker_suppress_tokens(self.config)
        self.context_len = int(self.config.talker_config.text_config.max_position_embeddings)

    def voices(self) -> list[str]:
        return qwen3_omni.speakers(self.config)

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        try:
            speaker = qwen3_omni.speaker_id(self.config, request.voice, self.args.default_voice)
        except KeyError as exc:
            raise InvalidStageInput(f"stage {self.stage_name}: {exc.args[0]}", "voice") from None
        chunks: AsyncIterator[HandoffPayload] | None = request.handoff_stream  # a streamed call
        first = await anext(chunks, None) if chunks is not None else handoff
        if first is None or first.kind != qwen3_omni.THINKER2TALKER:
            raise InvalidStageInput(f"stage {self.stage_name}: the talker needs a {qwen3_omni.THINKER2TALKER} handoff")
        thinker = qwen3_omni.ThinkerRows(first, self.config.im_start_token_id)
        # A streamed handoff: the rest of the reply's rows come while the talker runs. It starts once
        # the reply's first row is here, and each decoding step waits for the row it adds (the job's
        # `Rows`), so it never runs ahead of the thinker.
        rows = _Rows()
        if chunks is not None and not thinker.whole:
            while not thinker.can_start() and (chunk := await anext(chunks, None)) is not None:
                thinker.add(chunk)
            if not thinker.can_start():  # the reply ended before its first row: like a whole handoff
                rows.end()
        else:
            rows.end()
        feeding = asyncio.create_task(rows.feed(chunks)) if chunks is not None and not rows.ended else None

        def job(emit: Emit, cancelled: threading.Event) -> None:
            self._generate(request, thinker, rows, speaker, emit, cancelled)

        try:
            async with contextlib.aclosing(self._run(request.request_id, job)) as batches:
                async for batch in batches:
                    for item in batch:  # one output per chunk: each becomes its own code2wav call
                        if item[0] == "chunk":
                            yield StageOutput(stage=self.stage_name, handoff=item[1])
                        else:
                            _, last_chunk, reason, usage = item
                            yield StageOutput(
                                stage=self.stage_name,
                                handoff=last_chunk,
                                finished=True,
                                finish_reason=reason,
                                usage=usage,
                            )
        finally:
            if feeding is not None:
                feeding.cancel()
                with contextlib.suppress(BaseException):
                    await feeding

    def _generate(
        self,
        request: StageRequest,
        thinker: qwen3_omni.ThinkerRows,
        rows: _Rows,
        speaker: int,
        emit: Emit,
        cancelled: threading.Event,
    ) -> None:
        import torch

        s = request.sampling
        a = self.args
        chunker = qwen3_omni.CodecChunker(a.codec_first_chunk_frames, a.codec_chunk_frames, a.codec_left_context_frames)
        with torch.inference_mode():
            inputs = qwen3_omni.talker_inputs(thinker, self.talker, self.config, speaker)
        if inputs is None:  # the thinker said nothing: no speech
            emit(("final", None, FinishReason.STOP, Usage()))
            return
        # Frames it may make: max_tokens, within its context (a row per step is allocated up front, so a
        # request's max_tokens alone must not size it). One row per step the talker may take (HF's talker
        # runs frames + 1 steps).
        frames = max(1, min(s.max_tokens, self.context_len - int(inputs.inputs_embeds.shape[1]) - 1))
        trailing = qwen3_omni.TrailingText(inputs, frames + 2)

        def on_step(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            # Each decoding step's forward carries the residual codes of the token sampled one step
            # earlier (HF's hook for them): together with it, one complete frame of all code groups.
            codes = output.hidden_states[-1]
            if codes is not None:
                for chunk in chunker.push(codes[0].cpu().numpy()):
                    emit(("chunk", chunk))

        steps = 0

        def next_row_ready() -> None:
            # After step `steps` (the prefill is step 0), HF's next step adds trailing row `steps - 1`.
            nonlocal steps
            steps += 1
            rows.wait(trailing, steps - 1, self.talker, cancelled)

        ends = end_ids([self.config.talker_config.codec_eos_token_id], set(s.stop_token_ids), s.ignore_eos)
        hook = self.talker.register_forward_hook(on_step, with_kwargs=True)
        try:
            with _RNG_LOCK, torch.inference_mode():
                torch.manual_seed(_seed(s))
                sequences = self.talker.generate(
                    **inputs.as_kwargs(trailing),
                    generation_config=_generation_config(
                        s,
                        # HF's talker never gives the last sampled token residual codes: one more step
                        # yields that many complete frames.
                        max_new_tokens=frames + 1,
                        eos_token_id=ends,
                        pad_token_id=self.config.talker_config.codec_eos_token_id,  # batch of one: never padded
                        suppress_tokens=self.suppress_tokens,
                        output_hidden_states=True,  # the residual codes travel in the hidden states
                        return_dict_in_generate=True,
                    ),
                    stopping_criteria=_stopping(cancelled, self.args.min_step_s, before_next=next_row_ready),
                ).sequences
        finally:
            hook.remove()
        last = int(sequences[0, -1]) if sequences.shape[1] else None
        if cancelled.is_set():
            reason = FinishReason.ABORT
        elif last in ends:
            reason = FinishReason.STOP
        else:
            reason = FinishReason.LENGTH
        rest = chunker.flush()
        for chunk in rest[:-1]:
            emit(("chunk", chunk))
        usage = Usage(prompt_tokens=int(inputs.inputs_embeds.shape[1]), completion_tokens=chunker.num_frames)
        emit(("final", rest[-1] if rest else None, reason, usage))


class _Rows:
    """A streamed thinker handoff's rows on their way from the event loop to the talker's job thread.

    :meth:`feed` (a task on the loop) queues each chunk's rows as it arrives, then the end (or the
    producer's failure); :meth:`wait` (in the job, between decoding steps) projects what has come into
    the talker's :class:`TrailingText` until the row the next step adds is there. A failed producer
    fails the talker's call: its audio would be missing the reply's end.
    """

    _END = object()

    def __init__(self) -> None:
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self.ended = False

    def end(self) -> None:
        self.ended = True
        self._queue.put(self._END)

    async def feed(self, chunks: AsyncIterator[HandoffPayload]) -> None:
        try:
            async for chunk in chunks:
                self._queue.put(qwen3_omni.reply_rows(chunk))
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._queue.put(_Failure(err))
            return
        self.end()

    def wait(self, trailing: qwen3_omni.TrailingText, step: int, talker: Any, cancelled: threading.Event) -> None:
        import torch

        while not trailing.ready(step) and not cancelled.is_set():
            try:
                item = self._queue.get(timeout=0.05)  # polls the abort flag meanwhile
            except Empty:
                continue
            if item is self._END:
                trailing.finish()
            elif isinstance(item, _Failure):
                raise EngineError(f"the talker's input stream failed ({type(item.exc).__name__})") from item.exc
            else:
                with torch.inference_mode():
                    rows = torch.from_numpy(np.array(item, copy=True))[None].to(talker.device)
                    trailing.extend(qwen3_omni.project_rows(talker, rows.to(talker.dtype)))


# --- code2wav ------------------------------------------------------------------------------


class Code2WavEngine(_HFEngine):
    """One codec chunk -> its float32 24 kHz waveform, left context trimmed."""

    def _setup(self, model: Any) -> None:
        self.code2wav = model.code2wav

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        if handoff is None or handoff.kind != qwen3_omni.CODEC_CHUNK:
            raise InvalidStageInput(f"stage {self.stage_name}: code2wav needs a {qwen3_omni.CODEC_CHUNK} handoff")

        def job(emit: Emit, cancelled: threading.Event) -> None:
            pacer = StepPacer(self.args.min_step_s, cancelled)
            audio = qwen3_omni.decode_codec_chunk(self.code2wav, handoff)
            pacer.step_done()  # code2wav decodes a chunk in one step
            emit(audio)

        async with contextlib.aclosing(self._run(request.request_id, job)) as batches:
            async for batch in batches:
                yield StageOutput(
                    stage=self.stage_name,
                    audio=batch[0],
                    sample_rate=qwen3_omni.SAMPLE_RATE,
                    finished=True,
                    finish_reason=FinishReason.STOP,
                    usage=Usage(prompt_tokens=int(handoff.meta.get("num_frames", 0))),
                )
