"""A handoff between two vLLM-Omni stages, built by the pipeline's own declared input processors.

vLLM-Omni moves a request from stage to stage inside one process tree, in up to three declared steps:

1. **Producer side, whole** (``custom_process_next_stage_input_func``, e.g. ``*_full_payload``): when a
   request finishes, the producer's worker packs an ``OmniPayload`` from the output it accumulated and
   its connector sends it to the consumer's worker.
2. **Producer side, per chunk** (``async_chunk_process_next_stage_input_func``, where the deploy config
   turns ``async_chunk`` on): the same, once per engine step, with the adapter's per-request state
   (frames so far, chunks sent) kept on a ``transfer_manager``; the consumer reads the chunks as they
   come.
3. **Consumer side** (``custom_process_input_func``, or ``sync_process_input_func`` without async
   chunks): the orchestrator turns the producer's ``RequestOutput`` into the consumer's prompt, often a
   placeholder sized for what the payload brings (``*_token_only``); without one, the consumer's prompt
   is the producer's output token ids. A payload that arrives is applied as vLLM-Omni's worker and
   scheduler apply it (:func:`apply_payload`).

Here each stage is its own Serve replica, so the payload crosses the Ray object store instead of a
connector: :class:`Producer` runs steps 1 and 2 in the producer's replica, :func:`consumer_prompt`
step 3 in the consumer's, on the views :mod:`.payload` rebuilds. Which function runs comes from the
stage's ``StagePipelineConfig``, never from a model name; what the declaration leaves out comes from
the pipeline's hooks (:mod:`.hooks`). No engine, no Ray: testable on CPU with tensors.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from omni_serve.models.vllm_omni.hooks import StageHooks, StepRows
from omni_serve.models.vllm_omni.payload import (
    as_steps,
    from_handoff,
    model_config_view,
    request_view,
    source_meta,
    source_view,
    to_handoff,
)
from omni_serve.payload import HandoffPayload

PROCESSORS = "vllm_omni.model_executor.stage_input_processors."
# An upstream output handed on as it is: its stage declares no producer-side processor, so the
# consumer's processor reads the output itself (its token ids, text and multimodal output).
SOURCE_OUTPUT = "vllm_omni.source_output"


@functools.cache
def function(path: str) -> Callable[..., Any]:
    """A declared processor by its dotted path (``module.function``)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def kind(path: str) -> str:
    """The payload kind of what processor ``path`` builds, e.g. ``vllm_omni.qwen3_omni.thinker2talker_full_payload``."""
    return "vllm_omni." + path.removeprefix(PROCESSORS)


def input_processor(stage: Any) -> str | None:
    """The consumer-side processor of ``stage`` for whole handoffs: vLLM-Omni's pick without async chunks
    (``stage_config._select_processor_funcs``)."""
    return stage.sync_process_input_func or stage.custom_process_input_func


def producer_kinds(stage: Any) -> set[str]:
    """The kinds of handoff a stage may hand on (whole, per chunk, or its output as it is)."""
    paths = (stage.custom_process_next_stage_input_func, stage.async_chunk_process_next_stage_input_func)
    return {SOURCE_OUTPUT} | {kind(p) for p in paths if p}


def _flat(multimodal_output: Mapping[str, Any]) -> dict[str, Any]:
    from vllm_omni.data_entry_keys import flatten_payload

    return dict(flatten_payload(dict(multimodal_output)))


def runner_keys(flat: dict[str, Any], stage: Any) -> dict[str, Any]:
    """A stage's multimodal output under the key its model runner produced it, as a producer-side processor reads
    it worker-side: vLLM-Omni's client renames an AR runner's ``hidden`` (a generation runner's ``model_outputs``)
    to the stage's ``engine_output_type`` (``MultimodalPayload.from_raw``). Qwen2.5-Omni's
    ``thinker2talker_full_payload`` reads ``hidden``; here it would find only ``latent``."""
    key = (stage.engine_output_type or "").lower()
    ar = str(getattr(stage.execution_type, "value", stage.execution_type)) == "llm_ar"
    produced = "hidden" if ar else "model_outputs"
    if not key or key == produced or key not in flat or produced in flat:
        return flat
    return {**{k: v for k, v in flat.items() if k != key}, produced: flat[key]}


def _consolidated(value: Any) -> Any:
    """One tensor from a value vLLM-Omni accumulated as a list of per-step tensors."""
    import torch

    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, torch.Tensor) for v in value):
        return torch.cat([v.reshape(-1, v.shape[-1]) for v in value])
    return value


def first_rows(multimodal_output: Mapping[str, Any], rows: int, positions: int) -> dict[str, Any]:
    """A finished request's accumulated output (flat keys) cut to its first ``rows`` positions: a reply cut
    short before a tool call hands downstream only its spoken part (omni_serve.models.tool_calls).

    A value holds a row per position when it has at least ``positions`` rows (the prompt's length: every
    prompt position was computed); any other value is the request's own and is kept whole.
    """
    import torch

    cut: dict[str, Any] = {}
    for key, value in _flat(multimodal_output).items():
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            value = torch.cat(list(value), dim=0)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] >= positions:
            value = value[:rows]
        cut[key] = value
    return cut


# ---------------------------------------------------------------------------
# The producer side
# ---------------------------------------------------------------------------


@dataclass
class Producer:
    """One stage's side of its outgoing edge: what it hands downstream, built by its declared processors."""

    stage: Any  # its StagePipelineConfig
    hf_config: Any
    hooks: StageHooks
    chunk_config: Mapping[str, Any] | None = None  # the async-chunk connector's ``extra`` (chunk sizes)
    max_num_seqs: int = 1

    def whole(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        multimodal_output: Mapping[str, Any],
        *,
        text: str = "",
        stopped: bool = True,
        rows: Mapping[str, Any] | None = None,
    ) -> HandoffPayload | None:
        """The handoff of one finished request: the producer-side processor's payload (None if it withholds
        one), or the output itself where the stage declares none.

        ``multimodal_output`` is what the engine accumulated for the request (nested or dotted keys);
        ``rows`` replaces the values of the hooks' ``generated_rows_only`` keys with the rows the engine
        collected for generated positions (None: there were none); ``stopped``: it finished on a stop token.
        """
        flat = _flat(multimodal_output)
        for key, value in (rows or {}).items():
            if value is None:  # no generated rows: the processor sees none (not the prompt's placeholders)
                flat.pop(key, None)
            else:
                flat[key] = value
        meta = source_meta(prompt_token_ids, output_token_ids, text)
        path = self.stage.custom_process_next_stage_input_func
        if path is None:
            return to_handoff(SOURCE_OUTPUT, {k: _consolidated(v) for k, v in flat.items()}, **meta)
        request = request_view(request_id, prompt_token_ids, output_token_ids, stopped=stopped)
        payload = function(path)(model_config_view(self.hf_config), runner_keys(flat, self.stage), request)
        if payload is None:
            return None
        if self.hooks.fix_payload is not None:
            self.hooks.fix_payload(payload, flat, self.hf_config, len(prompt_token_ids) + len(output_token_ids))
        return to_handoff(kind(path), payload, **meta)

    def chunks(
        self, request_id: str, prompt_token_ids: Sequence[int], stop_token_ids: Sequence[int] = ()
    ) -> ChunkTransfer:
        """One request's chunks, cut by the stage's async-chunk processor."""
        path = self.stage.async_chunk_process_next_stage_input_func
        if path is None:
            raise ValueError(f"stage {self.stage.model_stage!r} declares no async-chunk processor")
        return ChunkTransfer(
            function(path),
            kind(path),
            request_id,
            list(prompt_token_ids),
            self.hf_config,
            dict(self.chunk_config or {}),
            self.hooks.step_rows,
            list(stop_token_ids),
            self.max_num_seqs,
            self.hooks.stateless_chunk,
        )


class NewRows:
    """New rows of one request's accumulating multimodal tensor, output by output, without re-concatenating.

    vLLM-Omni accumulates such a value per request: one tensor after the prefill step, then a growing
    list of per-step tensors, and one consolidated tensor when the request finishes. ``new`` returns the
    rows not seen before, from any of these shapes. ``placeholders``: all-zero rows (a stage's
    placeholders for prompt positions) are dropped from what it returns, still counted as seen.
    """

    def __init__(self, placeholders: bool = False) -> None:
        self.placeholders = placeholders
        self.rows = 0  # rows seen, placeholders included
        self._parts = 0  # list parts already seen, and the rows they hold
        self._parts_rows = 0

    def new(self, value: Any) -> Any:
        import torch

        if isinstance(value, (list, tuple)):
            if self._parts_rows > self.rows or len(value) < self._parts:
                self._parts = self._parts_rows = 0
            fresh = []
            for part in value[self._parts :]:
                part = _rows(part)
                skip = max(self.rows - self._parts_rows, 0)
                if skip < len(part):
                    fresh.append(part[skip:])
                self._parts += 1
                self._parts_rows += len(part)
            rows = torch.cat(fresh) if fresh else None
        elif isinstance(value, torch.Tensor):
            rows = _rows(value)[self.rows :]
            self._parts = self._parts_rows = 0  # a list that follows is walked from its start once
        else:
            rows = None
        if rows is None or len(rows) == 0:
            return None
        self.rows += len(rows)
        if self.placeholders:
            rows = rows[rows.any(dim=1)]
        return rows.detach().cpu() if len(rows) else None


def _rows(value: Any) -> Any:
    """A tensor as its rows: a row a position (a vector's rows are its elements, e.g. a per-position flag)."""
    return value.reshape(-1) if value.dim() <= 1 else value.reshape(-1, value.shape[-1])


def lookup(mm: Mapping[str, Any], dotted: str) -> Any:
    """A multimodal output's value by dotted path, stored flat or nested (None if absent)."""
    if dotted in mm:
        return mm[dotted]
    head, _, rest = dotted.partition(".")
    if head in mm:
        value = mm[head]
        return (lookup(value, rest) if isinstance(value, Mapping) else None) if rest else value
    for key, value in mm.items():  # an integer key (a layer index) spelled as text in the path
        if str(key) == head:
            return (lookup(value, rest) if isinstance(value, Mapping) else None) if rest else value
    return None


def _first(value: Any) -> Any:
    """A value that comes again with every step (a list of it, or one tensor of them once consolidated): the first."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value[:1] if getattr(value, "ndim", 0) == 3 else value


@dataclass
class ChunkTransfer:
    """vLLM-Omni's connector adapter for one request of a stage whose edge streams (the ``transfer_manager``
    its async-chunk processor keeps per-request state on: frames so far, chunks sent, chunk sizes).

    :meth:`push` takes each engine output, splits what it accumulated back into the engine steps it
    covers (:class:`~omni_serve.models.vllm_omni.hooks.StepRows`: the prompt's rows with the prefill
    step, then one row a decoding step; an output read late covers several), and calls the processor
    once per step, as the runner does; it returns the chunks those calls made, each numbered.
    """

    processor: Callable[..., Any]
    payload_kind: str
    request_id: str
    prompt_token_ids: list[int]
    hf_config: Any
    extra: dict[str, Any]
    step_rows: StepRows
    stop_token_ids: list[int] = field(default_factory=list)
    scheduler_max_num_seqs: int = 1
    stateless_chunk: Callable[[Any, Any], Any] | None = None  # StageHooks.stateless_chunk
    # The transfer manager's own state, which the processors read and write.
    put_req_chunk: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    request_payload: dict[str, Any] = field(default_factory=dict)
    code_prompt_token_ids: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    _rows: dict[str, NewRows] = field(default_factory=dict)
    _sent_rows: int = 0
    _prefill_rows: int | None = None  # the prefill step's rows, from the first output with rows

    @property
    def connector(self) -> SimpleNamespace:
        return SimpleNamespace(config={"extra": self.extra})

    @property
    def config(self) -> SimpleNamespace:  # what processors read the model config from
        return SimpleNamespace(hf_config=self.hf_config)

    def _get_model_config(self) -> SimpleNamespace:
        return self.config

    def push(
        self, multimodal_output: Mapping[str, Any], output_token_ids: Sequence[int], finished: bool
    ) -> list[HandoffPayload]:
        """One engine output (its accumulated multimodal output); the chunks its steps completed."""
        fresh: dict[str, Any] = {}
        for path in self._row_paths(multimodal_output):
            fresh[path] = self._rows.setdefault(path, NewRows()).new(lookup(multimodal_output, path))
        counts = {len(r) for r in fresh.values() if r is not None}
        if len(counts) > 1:
            raise ValueError(f"multimodal rows grew unevenly this output: {sorted(counts)} rows")
        new = counts.pop() if counts else 0
        # One processor call a step, as vLLM-Omni's runner makes them: the prefill's rows in one call, then one
        # row a call. Synchronous scheduling: each step samples one token, so the prefill's rows are the first
        # output's rows less its decoding steps' (one a token after the first). A stage with a row for every
        # position computed (Qwen3-TTS's talker) has the prompt's; one with a row a generated frame only
        # (Voxtral's), one.
        if self._prefill_rows is None and new:
            self._prefill_rows = min(max(new - len(output_token_ids) + 1, 1), len(self.prompt_token_ids))
        prompt = self._prefill_rows or 0
        in_prompt = min(max(prompt - self._sent_rows, 0), new)
        spans = ([(0, in_prompt)] if in_prompt else []) + [(i, i + 1) for i in range(in_prompt, new)]
        spans = spans or ([(0, 0)] if finished else [])  # (0, 0): the end, no row
        chunks = []
        for i, (a, b) in enumerate(spans):
            self._sent_rows += b - a
            replied = max(self._sent_rows - prompt, 0)
            last = finished and i == len(spans) - 1
            request = request_view(
                self.request_id,
                self.prompt_token_ids,
                list(output_token_ids)[: replied + 1],
                self.stop_token_ids,
                finished=last,
            )
            step = self._step(multimodal_output, {p: (r[a:b] if r is not None else r) for p, r in fresh.items()})
            payload = self.processor(self, step, request, last)
            if payload is not None and self.stateless_chunk is not None:
                payload = self.stateless_chunk(self, payload)
            if payload is None:  # nothing to send yet (the processor holds it), as upstream
                continue
            chunk = self.put_req_chunk[self.request_id]
            self.put_req_chunk[self.request_id] += 1  # what the transfer manager does after a put
            chunks.append(to_handoff(self.payload_kind, payload, chunk=chunk))
        return chunks

    def _row_paths(self, mm: Mapping[str, Any]) -> list[str]:
        """The dotted paths of the values that gain rows (under the step rows' prefixes)."""
        paths = []
        for prefix in self.step_rows.rows:
            value = lookup(mm, prefix)
            if isinstance(value, Mapping):
                paths += [f"{prefix}.{key}" for key in value]
            elif value is not None:
                paths.append(prefix)
        return paths

    def _step(self, mm: Mapping[str, Any], rows: Mapping[str, Any]) -> dict[str, Any]:
        """One step's output: its rows where values gain rows, every other value as its first."""

        def build(value: Any, path: str) -> Any:
            if path in rows:
                return rows[path]
            if isinstance(value, Mapping):
                inner = {k: build(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
                # A value that gained no rows this step is left out, as the runner's step output has none.
                return {k: v for k, v in inner.items() if not (v is None and f"{path}.{k}".lstrip(".") in rows)}
            return _first(value)

        return build(mm, "")


# ---------------------------------------------------------------------------
# The consumer side
# ---------------------------------------------------------------------------


# Where a handoff carries its request's entry prompt (:func:`with_entry_prompt`): its fields in meta, its media
# (the image to edit) as arrays under this prefix.
ENTRY_PROMPT = "entry_prompt"


def with_entry_prompt(handoff: HandoffPayload, prompt: Mapping[str, Any], seed: int | None = None) -> HandoffPayload:
    """``handoff`` carrying the entry stage's prompt, which vLLM-Omni hands a consumer-side processor as the
    request's original prompt (its ``prompt`` argument: GLM-Image's ``ar2diffusion`` reads the target size,
    the modalities and the image to edit from it), and the seed the entry stage ran with. Images (PIL) travel as
    uint8 arrays, by reference with the rest of the handoff; the other fields are small and go in its meta."""
    media = {key: np.asarray(value.convert("RGB")) for key, value in (prompt.get("multi_modal_data") or {}).items()}
    fields = {key: value for key, value in prompt.items() if key != "multi_modal_data"}
    tensors = {**handoff.tensors, **{f"{ENTRY_PROMPT}.{key}": array for key, array in media.items()}}
    meta = {**handoff.meta, ENTRY_PROMPT: fields, "entry_media": list(media), "seed": seed}
    return HandoffPayload(handoff.kind, tensors, meta)


def entry_prompt_of(handoff: HandoffPayload) -> dict[str, Any]:
    """The entry prompt a handoff carries (:func:`with_entry_prompt`), its images as PIL images again; empty if none."""
    from PIL import Image

    prompt = dict(handoff.meta.get(ENTRY_PROMPT) or {})
    media = {
        key: Image.fromarray(handoff.tensors[f"{ENTRY_PROMPT}.{key}"]) for key in handoff.meta.get("entry_media", ())
    }
    if media:
        prompt["multi_modal_data"] = media
    return prompt


def _output_only(handoff: HandoffPayload) -> HandoffPayload:
    """A handoff without the entry prompt's arrays: the upstream's output alone."""
    media = {f"{ENTRY_PROMPT}.{key}" for key in handoff.meta.get("entry_media", ())}
    if not media:
        return handoff
    return HandoffPayload(handoff.kind, {k: v for k, v in handoff.tensors.items() if k not in media}, handoff.meta)


def source_output(handoff: HandoffPayload, request_id: str) -> SimpleNamespace:
    """The upstream ``RequestOutput`` a consumer-side processor reads, from a handoff's meta (and, for an
    output handed on as it is, its multimodal output)."""
    multimodal = from_handoff(_output_only(handoff)) if handoff.kind == SOURCE_OUTPUT else {}
    meta = handoff.meta
    return source_view(
        request_id,
        meta.get("prompt_token_ids", ()),
        meta.get("output_token_ids", ()),
        meta.get("text", ""),
        multimodal,
    )


def run_input_processor(
    path: str,
    sources: list[Any],
    prompt: Any,
    requires_multimodal_data: bool,
    *,
    hf_config: Any = None,
    model_config: Any = None,
) -> list[dict[str, Any]]:
    """A consumer-side processor, called as vLLM-Omni's stage client calls it (``_call_custom_process_input``):
    the extra context it asks for by parameter name."""
    processor = function(path)
    parameters = inspect.signature(processor).parameters
    extra: dict[str, Any] = {}
    if "next_stage_hf_config" in parameters:
        extra["next_stage_hf_config"] = hf_config
    if "target_model_config" in parameters:
        extra["target_model_config"] = model_config
    args: list[Any] = [sources, prompt, requires_multimodal_data]
    if "streaming_context" in parameters or "_streaming_context" in parameters:
        args.append(SimpleNamespace(enabled=False, bridge_states={}, source_token_decoder=None))
    made = processor(*args, **extra)
    if isinstance(made, Mapping):  # one input (GLM-Image's ar2diffusion returns its DiT request's dict)
        made = [made]
    return [dict(p) for p in made or []]


def diffusion_input(stage: Any, handoffs: Sequence[HandoffPayload], *, request_id: str) -> dict[str, Any]:
    """A DiT stage's request (its diffusion prompt) from its upstream stages' handoffs: its declared input processor
    (e.g. ``ar2diffusion``: the AR's tokens -> prior token ids and size) called as vLLM-Omni's orchestrator calls
    it, with the request's entry prompt as the original prompt. ValueError when it makes none."""
    path = input_processor(stage)
    if path is None:
        raise ValueError(f"stage {stage.model_stage!r} declares no input processor to build its DiT request with")
    prompt = entry_prompt_of(handoffs[0]) if handoffs else {}
    sources = [source_output(h, request_id) for h in handoffs]
    made = run_input_processor(path, sources, prompt, bool(stage.requires_multimodal_data))
    if not made:
        raise ValueError(f"stage {stage.model_stage!r}: its input processor made no DiT request of the upstream output")
    return made[0]


def consumer_prompt(
    stage: Any,
    handoffs: Sequence[HandoffPayload],
    *,
    upstream: Sequence[Any] = (),
    request_id: str,
    voice: str | None = None,
    generation: bool = False,
    hf_config: Any = None,
    model_config: Any = None,
) -> dict[str, Any]:
    """The prompt of one call of ``stage`` (its StagePipelineConfig) from its upstream stages' handoffs, in
    the order of its ``input_sources`` (``upstream``: their StagePipelineConfigs, to check what came):
    its input processor's prompt, with the payloads applied.

    ``voice`` reaches the processor in the request's ``additional_information`` (where vLLM-Omni's API
    puts it) and an autoregressive consumer's model as ``speaker``. ``generation``: the stage is an
    ``llm_generation`` stage (codec ids in a payload become its prompt).
    """
    if upstream and len(handoffs) != len(upstream):
        raise ValueError(
            f"stage {stage.model_stage!r} reads {len(upstream)} upstream stages, got {len(handoffs)} handoffs"
        )
    for handoff, producer in zip(handoffs, upstream, strict=False):
        if handoff.kind not in producer_kinds(producer):
            raise ValueError(f"expected a handoff of {sorted(producer_kinds(producer))}, got {handoff.kind!r}")
    sources = [source_output(h, request_id) for h in handoffs]
    original: dict[str, Any] = {"additional_information": {"speaker": [voice]} if voice else {}}
    path = input_processor(stage)
    if path is not None:
        prompts = run_input_processor(
            path,
            sources,
            original,
            bool(stage.requires_multimodal_data),
            hf_config=hf_config,
            model_config=model_config,
        )
    else:  # vLLM-Omni's default: the upstream's output token ids
        prompts = [{"prompt_token_ids": list(s.outputs[0].token_ids)} for s in sources]
    payloads = [from_handoff(h) for h in handoffs if h.kind != SOURCE_OUTPUT]
    if not prompts and not payloads:
        raise ValueError(f"stage {stage.model_stage!r}: its input processor made no input of the upstream output")
    prompt = prompts[0] if prompts else {"prompt_token_ids": []}
    for payload in payloads:
        apply_payload(prompt, payload, generation)
    if voice and not generation:
        prompt["additional_information"] = {**(prompt.get("additional_information") or {}), "speaker": voice}
    return prompt


def apply_payload(prompt: dict[str, Any], payload: dict[str, Any], generation: bool) -> None:
    """A producer's payload applied to the consumer's prompt, as vLLM-Omni's worker and scheduler apply one
    that arrives on the connector (``update_request_metadata``, the runner's model buffer).

    The payload becomes the request's ``additional_information`` (the model's intermediate buffer);
    ``meta.next_stage_prompt_len`` sizes an autoregressive stage's prompt; for a generation stage the
    codec ids (``codes.audio``) become the prompt and ``meta.left_context_size`` seeds its buffer.
    """
    meta = payload.get("meta") or {}
    info = dict(prompt.get("additional_information") or {})
    if generation:
        codes = (payload.get("codes") or {}).get("audio")
        if codes is not None:
            prompt["prompt_token_ids"] = (
                codes.reshape(-1).tolist() if hasattr(codes, "reshape") else [int(c) for c in codes]
            )
        left = meta.get("left_context_size")
        rest = {k: v for k, v in payload.items() if k not in ("codes", "meta")}
        info.update(rest)
        if left is not None:
            info["meta"] = {"left_context_size": int(left)}
    else:
        length = meta.get("next_stage_prompt_len")
        if isinstance(length, int) and length > 0:
            prompt["prompt_token_ids"] = [0] * length
        info.update(payload)
    if info:
        prompt["additional_information"] = info
    else:
        prompt.pop("additional_information", None)


def chunk_steps(chunk: HandoffPayload) -> list[HandoffPayload]:
    """The connector chunks in one streamed input item (a run of steps, or one chunk)."""
    from omni_serve.models.vllm_omni.payload import split_steps

    return split_steps(chunk)


def run_of(chunks: Sequence[HandoffPayload]) -> HandoffPayload | None:
    """Chunks one engine output completed, as one stream item of numbered steps (None if there are none)."""
    return as_steps(chunks) if chunks else None
