"""Stage-to-stage handoffs of the ``vllm_omni`` family, built by vLLM-Omni's own stage input processors.

vLLM-Omni moves a request between stages inside one process tree: a producer-side
processor (``thinker2talker_full_payload``, ``talker2code2wav_*``) packs an
``OmniPayload`` dict in the producer's worker, a connector carries it, and the
consumer gets a placeholder prompt from a consumer-side processor
(``thinker2talker_token_only``) plus the payload in its ``model_intermediate_buffer``.

Here each stage is its own Serve replica, so the payload crosses the Ray object
store instead of a connector. This module is the pure part of that trip, testable
on CPU: call the real processor, turn its torch payload into a
:class:`~omni_serve.types.HandoffPayload` (numpy; bf16 kept as raw 16-bit words, so
nothing is widened), and on the consumer side rebuild the processor's input objects
and the stage prompt. No engine, no Ray. torch and vllm_omni are imported inside the
functions: the module stays importable where they are not installed.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from omni_serve.payload import HandoffPayload, arrays, tensor


@dataclass(frozen=True)
class Pipeline:
    """A vLLM-Omni pipeline omni_serve has handoffs for."""

    short: str  # in payload kinds, and the name of vLLM-Omni's stage input processor module
    topology: str  # vLLM-Omni's PipelineConfig object (module:attribute), for graph generation
    default_model: str  # the reference checkpoint a generated graph serves
    tool_call_parser: str  # vLLM's tool parser of the thinker's tool-call syntax (omni_serve.models.tool_calls)


# vLLM-Omni pipeline model_type -> what omni_serve knows of it (handoffs here, graphs in omni_serve.cli.graphs).
PIPELINES: dict[str, Pipeline] = {
    "qwen3_omni_moe": Pipeline(
        "qwen3_omni",
        "vllm_omni.model_executor.models.qwen3_omni.pipeline:QWEN3_OMNI_PIPELINE",
        "Qwen/Qwen3-Omni-30B-A3B-Instruct",
        "hermes",
    ),
    "qwen2_5_omni": Pipeline(
        "qwen2_5_omni",
        "vllm_omni.model_executor.models.qwen2_5_omni.pipeline:QWEN2_5_OMNI_PIPELINE",
        "Qwen/Qwen2.5-Omni-7B",
        "hermes",
    ),
}
PROCESSORS = "vllm_omni.model_executor.stage_input_processors."

THINKER2TALKER = "thinker2talker"
TALKER2CODE2WAV = "talker2code2wav"


def kind(pipeline: str, edge: str) -> str:
    """Payload kind for one edge of one pipeline, e.g. ``vllm_omni.qwen3_omni.thinker2talker``."""
    return f"vllm_omni.{PIPELINES[pipeline].short}.{edge}"


def processors(pipeline: str) -> Any:
    """vLLM-Omni's stage input processor module of a pipeline."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline {pipeline!r} has no vllm_omni handoffs here (known: {sorted(PIPELINES)})")
    return importlib.import_module(PROCESSORS + PIPELINES[pipeline].short)


# ---------------------------------------------------------------------------
# OmniPayload (torch, nested) <-> HandoffPayload (numpy, flat)
# ---------------------------------------------------------------------------


def to_handoff(payload_kind: str, payload: Any, **meta: Any) -> HandoffPayload:
    """Flatten a processor's ``OmniPayload`` (dict or struct) into numpy arrays plus small values.

    Tensors (moved to CPU) become arrays (bf16 as 16-bit words, :func:`omni_serve.graph.transport.arrays`);
    lists of ints (token or codec ids) become int64 arrays; everything else (speaker, scalars) stays
    in ``meta["values"]``.
    """
    import torch
    from vllm_omni.data_entry_keys import OmniPayloadStruct, flatten_payload, to_dict

    if isinstance(payload, OmniPayloadStruct):  # the async-chunk processors return structs
        payload = to_dict(payload)
    torch_tensors: dict[str, torch.Tensor] = {}
    tensors: dict[str, np.ndarray] = {}
    lists: list[str] = []
    values: dict[str, Any] = {}
    for key, value in flatten_payload(payload).items():
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], torch.Tensor):
            value = value[0]  # per-step lists of one tensor (e.g. thinker tts embeds)
        if isinstance(value, torch.Tensor):
            torch_tensors[key] = value
        elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            tensors[key] = np.asarray(value, dtype=np.int64)
            lists.append(key)
        else:
            values[key] = value
    packed, dtypes = arrays(torch_tensors)
    tensors.update(packed)
    return HandoffPayload(
        kind=payload_kind, tensors=tensors, meta={**meta, "dtypes": dtypes, "lists": lists, "values": values}
    )


def from_handoff(payload: HandoffPayload) -> dict[str, Any]:
    """Rebuild the nested ``OmniPayload`` (torch tensors on CPU) a processor or model reads."""
    from vllm_omni.data_entry_keys import unflatten_payload

    lists = set(payload.meta.get("lists", ()))
    flat: dict[str, Any] = dict(payload.meta.get("values", {}))
    for key, array in payload.tensors.items():
        flat[key] = [int(v) for v in array.tolist()] if key in lists else tensor(payload, key)
    return unflatten_payload(flat)


def expect(handoff: HandoffPayload, pipeline: str, edge: str) -> None:
    if handoff.kind != kind(pipeline, edge):
        raise ValueError(f"expected a {kind(pipeline, edge)!r} handoff, got {handoff.kind!r}")


# ---------------------------------------------------------------------------
# The objects vLLM-Omni's processors read, rebuilt from plain values
# ---------------------------------------------------------------------------


def _stage_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    stop_token_ids: Sequence[int] = (),
    stopped: bool = False,
) -> SimpleNamespace:
    """The fields of an ``OmniEngineCoreRequest`` the producer-side processors read."""
    return SimpleNamespace(
        status=SimpleNamespace(name="FINISHED_STOPPED" if stopped else "FINISHED_LENGTH_CAPPED"),
        request_id=request_id,
        external_req_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        output_token_ids=list(output_token_ids),
        all_token_ids=[*prompt_token_ids, *output_token_ids],
        additional_information=None,  # speaker travels in the prompt, see talker_prompt()
        sampling_params=SimpleNamespace(stop_token_ids=list(stop_token_ids), stop_token_id=None),
        resumable=False,
        num_computed_tokens=len(prompt_token_ids) + len(output_token_ids),
    )


def _source_output(
    request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]
) -> SimpleNamespace:
    """The fields of an upstream ``RequestOutput`` the consumer-side processors read."""
    completion = SimpleNamespace(token_ids=list(output_token_ids), cumulative_token_ids=list(output_token_ids))
    return SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(prompt_token_ids), outputs=[completion], finished=True
    )


def _model_config_view(hf_config: Any) -> SimpleNamespace:
    """What processors reach through ``transfer_manager`` for the model config."""
    return SimpleNamespace(config=SimpleNamespace(hf_config=hf_config))


# ---------------------------------------------------------------------------
# thinker -> talker
# ---------------------------------------------------------------------------


def thinker_handoff(
    pipeline: str,
    *,
    request_id: str,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    multimodal_output: Mapping[str, Any],
    hf_config: Any,
    stopped: bool = True,
) -> HandoffPayload | None:
    """Run ``thinker2talker_full_payload`` on the thinker's final output; None if it withholds one.

    ``multimodal_output`` is what the thinker engine accumulated for the request
    (captured layers, tts embeds; nested or dotted keys), ``hf_config`` the full
    model config (the processor reads ``talker_config.accept_hidden_layer``),
    ``stopped`` whether it finished on a stop token (that row is not handed on).
    """
    from vllm_omni.data_entry_keys import flatten_payload

    flat = flatten_payload(multimodal_output)
    request = _stage_request(request_id, prompt_token_ids, output_token_ids, stopped=stopped)
    payload = processors(pipeline).thinker2talker_full_payload(_model_config_view(hf_config), flat, request)
    if payload is None:
        return None
    _keep_computed_rows(payload, flat, hf_config, len(prompt_token_ids) + len(output_token_ids))
    return to_handoff(
        kind(pipeline, THINKER2TALKER),
        payload,
        prompt_token_ids=list(prompt_token_ids),
        output_token_ids=list(output_token_ids),
    )


def first_rows(multimodal_output: Mapping[str, Any], rows: int) -> dict[str, Any]:
    """A thinker's accumulated output cut to its first ``rows`` positions' hidden states (a reply cut short
    before a tool call: the talker gets only the spoken part; omni_serve.models.tool_calls)."""
    import torch
    from vllm_omni.data_entry_keys import flatten_payload

    def cut(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            parts = [v for v in value if isinstance(v, torch.Tensor)]
            value = torch.cat(parts, dim=0) if parts else value
        return value[:rows] if isinstance(value, torch.Tensor) else value

    flat = flatten_payload(multimodal_output)
    return {k: cut(v) if k.startswith("hidden_states.layer_") else v for k, v in flat.items()}


def _keep_computed_rows(payload: Any, flat: Mapping[str, Any], hf_config: Any, num_tokens: int) -> None:
    """Undo the processor's drop of the last hidden-state row when that row was never computed.

    ``thinker2talker_full_payload`` always drops the last accumulated row, assuming it belongs
    to the final sampled (stop) token. That holds with async scheduling (GPU), where the engine
    runs one step past the last sampled token; with synchronous scheduling (vLLM's CPU platform
    disables async scheduling) the final token never runs, so the engine holds
    ``num_tokens - 1`` rows and the drop would cut the last real token's row. The payload then
    keeps every computed row, as transformers' ``generate`` hands on every row it computed.
    (Upstream runs Qwen3-Omni with async scheduling only; no upstream issue found for this.)
    """
    accept = getattr(getattr(hf_config, "talker_config", None), "accept_hidden_layer", None)
    if accept is None or not isinstance(payload, dict):
        return
    embed, hidden = flat.get("hidden_states.layer_0"), flat.get(f"hidden_states.layer_{accept}")
    if embed is None or hidden is None or not all(t.shape[0] == num_tokens - 1 for t in (embed, hidden)):
        return
    payload["embed"]["prefill"] = embed.detach().cpu()
    payload["hidden_states"]["output"] = hidden.detach().cpu()


def talker_prompt(pipeline: str, handoff: HandoffPayload, *, request_id: str, voice: str | None) -> dict[str, Any]:
    """The talker's stage prompt: ``thinker2talker_token_only``'s placeholder plus the payload.

    The placeholder reserves the talker's prompt slots; the thinker payload rides in
    ``additional_information``, which the worker moves into the model's
    ``model_intermediate_buffer`` (where the connector would have put it).
    """
    expect(handoff, pipeline, THINKER2TALKER)
    source = _source_output(request_id, handoff.meta["prompt_token_ids"], handoff.meta["output_token_ids"])
    upstream_prompt: dict[str, Any] = {"additional_information": {"speaker": [voice]} if voice else {}}
    (prompt,) = processors(pipeline).thinker2talker_token_only([source], upstream_prompt, False)
    info = dict(prompt.get("additional_information") or {})
    info.update(from_handoff(handoff))
    if voice:
        info["speaker"] = voice
    prompt["additional_information"] = info
    return prompt


class NewRows:
    """New rows of one request's accumulating multimodal tensor, step by step, without re-concatenating old ones.

    vLLM-Omni accumulates a stage's per-step tensors per request (a talker's ``codes.audio``, a
    thinker's captured hidden-state layers): one tensor after the prefill step, then a growing list
    of per-step tensors, and one consolidated tensor when the request finishes. ``new`` returns the
    rows not seen before, from any of these shapes. ``placeholders``: the talker's codes hold an
    all-zero placeholder row per prompt position, dropped here (vLLM-Omni's own codec chunker skips
    those too).
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
                part = part.reshape(-1, part.shape[-1])
                skip = max(self.rows - self._parts_rows, 0)
                if skip < len(part):
                    fresh.append(part[skip:])
                self._parts += 1
                self._parts_rows += len(part)
            rows = torch.cat(fresh) if fresh else None
        elif isinstance(value, torch.Tensor):
            rows = value.reshape(-1, value.shape[-1])[self.rows :]
            self._parts = self._parts_rows = 0  # a list that follows is walked from its start once
        else:
            rows = None
        if rows is None or len(rows) == 0:
            return None
        self.rows += len(rows)
        if self.placeholders:
            rows = rows[rows.any(dim=1)]
        return rows.detach().cpu() if len(rows) else None


THINKER2TALKER_CHUNKS = "thinker2talker_async_chunk"


@dataclass
class ThinkerChunkTransfer:
    """Streams one thinker request's talker input as vLLM-Omni's async-chunk connector cuts it (Qwen3-Omni).

    Wraps ``thinker2talker_async_chunk``, which vLLM-Omni runs on each engine step of the thinker:
    the prompt's rows and the first reply row go out together (chunk 0, with the token ids and the
    tts embeddings), then one chunk per reply row (``embed.decode``), the last one marked finished.
    It keeps its per-request state on the ``transfer_manager`` it is given; this object plays that
    part (chunks sent, the held chunk 0, the model config it reads the accepted layer from).

    A streamed handoff here is a run of those chunks: :meth:`push` returns the chunks one engine
    output completes (an output may carry several steps when the stage reads it late), as one
    :class:`HandoffPayload` of numbered steps (:func:`chunk_steps` splits it, :func:`merge_chunks`
    joins two), so the talker replays them to its EngineCore one by one, as the connector would.
    """

    pipeline: str
    request_id: str
    hf_config: Any
    prompt_token_ids: Sequence[int]
    put_req_chunk: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    request_payload: dict[str, Any] = field(default_factory=dict)
    _rows: dict[int, NewRows] = field(default_factory=dict)  # per captured layer
    _sent_rows: int = 0

    @property
    def config(self) -> SimpleNamespace:  # what the processor reads the talker's accepted layer from
        return SimpleNamespace(hf_config=self.hf_config)

    def push(
        self, multimodal_output: Mapping[str, Any], output_token_ids: Sequence[int], finished: bool
    ) -> HandoffPayload | None:
        """One thinker engine output (its accumulated multimodal output); the chunks it completes, if any."""
        layers = multimodal_output.get("hidden_states", {}).get("layers", {})
        embed = {k: _first(v) for k, v in (multimodal_output.get("embed") or {}).items()}
        fresh = {}
        for layer, value in layers.items():
            rows = self._rows.setdefault(int(layer), NewRows()).new(value)
            fresh[int(layer)] = rows
        counts = {len(r) for r in fresh.values() if r is not None}
        if len(counts) > 1:
            raise ValueError(f"thinker layers grew unevenly this step: {sorted(counts)} rows")
        new = counts.pop() if counts else 0
        # One processor call a step, as upstream's runner makes them: the prompt's rows in one call (the
        # prefill's; the processor holds them in chunk 0, re-concatenating what it holds on each call, so not
        # one call a prompt row), then one reply row a call, the first joining chunk 0. An output read late
        # may carry several steps. Synchronous scheduling: the step that computes reply row r samples token r + 1.
        prompt = list(self.prompt_token_ids)
        in_prompt = min(max(len(prompt) - self._sent_rows, 0), new)  # this output's rows still of the prompt
        rows = ([(0, in_prompt)] if in_prompt else []) + [(i, i + 1) for i in range(in_prompt, new)]
        rows = rows or ([(0, 0)] if finished else [])  # (0, 0): the end, no row
        steps = []
        for i, (a, b) in enumerate(rows):
            self._sent_rows += b - a
            replied = max(self._sent_rows - len(prompt), 0)
            request = _stage_request(self.request_id, prompt, list(output_token_ids)[: replied + 1])
            step_layers = {k: r[a:b] for k, r in fresh.items() if r is not None}
            last = finished and i == len(rows) - 1
            payload = processors(self.pipeline).thinker2talker_async_chunk(
                self, {"hidden_states": {"layers": step_layers}, "embed": embed}, request, last
            )
            if payload is None:  # chunk 0 held until the first reply row joins it, as upstream does
                continue
            self.put_req_chunk[self.request_id] += 1  # what the transfer manager does after a put
            steps.append(to_handoff(kind(self.pipeline, THINKER2TALKER_CHUNKS), payload))
        return _as_steps(steps) if steps else None


def whole_as_chunks(pipeline: str, whole: HandoffPayload, hf_config: Any) -> HandoffPayload:
    """A whole thinker -> talker handoff as the async chunks streaming sends: what a talker built for streamed
    input reads when its thinker handed over whole (stop strings, or a caller with a finished handoff)."""
    expect(whole, pipeline, THINKER2TALKER)
    payload = from_handoff(whole)
    accept = int(hf_config.talker_config.accept_hidden_layer)
    embed = payload["embed"]
    layers = {0: embed["prefill"], accept: payload["hidden_states"]["output"]}
    tts = {k: v for k, v in embed.items() if k.startswith("tts_")}
    transfer = ThinkerChunkTransfer(pipeline, "whole", hf_config, whole.meta["prompt_token_ids"])
    chunks = transfer.push({"hidden_states": {"layers": layers}, "embed": tts}, whole.meta["output_token_ids"], True)
    if chunks is None:
        raise ValueError(f"{whole.kind}: no rows to speak")
    return chunks


def talker_chunk_prompt(first: HandoffPayload) -> dict[str, Any]:
    """A streamed talker's placeholder prompt, from the thinker's chunk 0, as vLLM-Omni's async-chunk
    prewarm sizes it (``compute_talker_prompt_ids_length`` of the thinker's prompt); the chunks bring the
    rest through the connector."""
    from vllm_omni.distributed.omni_connectors.adapter import compute_talker_prompt_ids_length

    prompt_ids = [int(i) for i in first.tensors.get("ids.prompt", ())]
    if not prompt_ids:
        raise ValueError(f"{first.kind}: the first chunk carries no prompt ids (ids.prompt)")
    return {"prompt_token_ids": [0] * max(1, compute_talker_prompt_ids_length(prompt_ids))}


def _first(value: Any) -> Any:
    """The thinker's tts embeddings come again with every step (a list, or one tensor of them once
    consolidated): the first one."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value[:1] if getattr(value, "ndim", 0) == 3 else value


def _as_steps(steps: Sequence[HandoffPayload]) -> HandoffPayload:
    tensors = {f"{i}/{k}": v for i, step in enumerate(steps) for k, v in step.tensors.items()}
    return HandoffPayload(steps[0].kind, tensors, {"steps": [step.meta for step in steps]})


def merge_chunks(first: HandoffPayload, later: HandoffPayload) -> HandoffPayload:
    """Two consecutive runs of thinker chunks as one (the stage coalesces them under load)."""
    return _as_steps([*chunk_steps(first), *chunk_steps(later)])


def chunk_steps(chunks: HandoffPayload) -> list[HandoffPayload]:
    """A run of thinker chunks, one payload per connector chunk, in order."""
    expect(chunks, "qwen3_omni_moe", THINKER2TALKER_CHUNKS)
    steps = [HandoffPayload(chunks.kind, {}, meta) for meta in chunks.meta["steps"]]
    for key, value in chunks.tensors.items():
        index, _, name = key.partition("/")
        steps[int(index)].tensors[name] = value
    return steps


# ---------------------------------------------------------------------------
# talker -> code2wav
# ---------------------------------------------------------------------------


def talker_handoff(
    pipeline: str,
    *,
    request_id: str,
    output_token_ids: Sequence[int],
    codes: Any | None,
) -> HandoffPayload | None:
    """Run ``talker2code2wav_full_payload`` on the talker's final output (whole utterance).

    ``codes`` is the talker's accumulated ``codes.audio`` ([frames, code groups],
    Qwen3-Omni); Qwen2.5-Omni's processor reads the codec ids from the output tokens.
    """
    pooling_output = {} if codes is None else {"codes.audio": codes}
    request = _stage_request(request_id, (), output_token_ids)
    payload = processors(pipeline).talker2code2wav_full_payload(None, pooling_output, request)
    if payload is None:
        return None
    return to_handoff(kind(pipeline, TALKER2CODE2WAV), payload)


@dataclass
class AsyncChunkTransfer:
    """Streams one talker request's codec frames as chunks with left context (Qwen3-Omni), cut by vLLM-Omni.

    Wraps ``talker2code2wav_async_chunk``: it keeps its per-request state on the
    ``transfer_manager`` it is given, so this object plays that part for one
    request (frames so far, chunks sent, the connector's chunk sizes). The transformers
    family, which runs without vLLM-Omni, cuts its chunks with ``qwen3_omni.CodecChunker``.
    """

    pipeline: str
    request_id: str
    chunk_frames: int = 25
    left_context_frames: int = 25
    initial_chunk_frames: int = 0
    stop_token_ids: Sequence[int] = ()
    code_prompt_token_ids: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    put_req_chunk: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def connector(self) -> SimpleNamespace:
        extra = {
            "codec_chunk_frames": self.chunk_frames,
            "codec_left_context_frames": self.left_context_frames,
            "initial_codec_chunk_frames": self.initial_chunk_frames,
        }
        return SimpleNamespace(config={"extra": extra})

    def push(self, frame: Any, finished: bool) -> HandoffPayload | None:
        """Feed one engine step's codes ([1, groups], or empty on the final step); maybe get a chunk."""
        request = _stage_request(self.request_id, (), (), self.stop_token_ids)
        payload = processors(self.pipeline).talker2code2wav_async_chunk(
            self, {"codes": {"audio": frame}}, request, finished
        )
        if payload is None:
            return None
        # What vLLM-Omni's transfer manager does after a successful put.
        self.put_req_chunk[self.request_id] += 1
        return to_handoff(kind(self.pipeline, TALKER2CODE2WAV), payload, chunk=self.put_req_chunk[self.request_id] - 1)


def code2wav_prompt(pipeline: str, handoff: HandoffPayload) -> dict[str, Any]:
    """The code2wav prompt: the flattened codec ids (codebook-major) as tokens, left context in meta.

    This is the prompt vLLM-Omni's scheduling coordinator gives a generation stage
    when a codec payload arrives (``prompt_token_ids`` = codes, buffer seeded with
    ``meta.left_context_size``).
    """
    expect(handoff, pipeline, TALKER2CODE2WAV)
    payload = from_handoff(handoff)
    codes = payload.get("codes", {}).get("audio")
    if codes is None:
        raise ValueError(f"{handoff.kind} handoff has no codes.audio")
    ids = codes.reshape(-1).tolist() if hasattr(codes, "reshape") else [int(c) for c in codes]
    meta = payload.get("meta", {})
    left = meta.get("left_context_size")
    info = {"meta": {"left_context_size": int(left)}} if left is not None else None
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if info is not None:
        prompt["additional_information"] = info
    return prompt
