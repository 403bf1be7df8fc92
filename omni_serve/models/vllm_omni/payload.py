"""vLLM-Omni's ``OmniPayload`` (nested torch dicts) <-> omni_serve's :class:`HandoffPayload`, and the views
of vLLM-Omni's objects its stage input processors read.

vLLM-Omni hands a processor a ``transfer_manager`` (its connector adapter), the stage's engine
request or its ``RequestOutput``; in omni_serve those objects live in other processes, so this module
rebuilds the fields the processors read from plain values (:func:`request_view`, :func:`source_view`,
:func:`model_config_view`). Pure: torch and vLLM-Omni are imported inside the functions, so the module
stays importable where they are not installed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from omni_serve.payload import HandoffPayload, arrays, tensor

# What a handoff's ``meta`` says of the upstream stage's output (the fields of its ``RequestOutput`` a
# consumer-side processor reads): the engine request's prompt and output token ids, and its text.
SOURCE_FIELDS = ("prompt_token_ids", "output_token_ids", "text")


def to_handoff(payload_kind: str, payload: Any, **meta: Any) -> HandoffPayload:
    """Flatten a processor's ``OmniPayload`` (dict or struct) into numpy arrays plus small values.

    Tensors (moved to CPU) become arrays (bf16 as 16-bit words, :func:`omni_serve.payload.arrays`);
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


def source_meta(prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], text: str = "") -> dict[str, Any]:
    """What a handoff carries of its upstream output besides the payload (:data:`SOURCE_FIELDS`)."""
    return {"prompt_token_ids": list(prompt_token_ids), "output_token_ids": list(output_token_ids), "text": text}


# ---------------------------------------------------------------------------
# The objects vLLM-Omni's processors read, rebuilt from plain values
# ---------------------------------------------------------------------------


def request_view(
    request_id: str,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    stop_token_ids: Sequence[int] = (),
    stopped: bool = False,
    finished: bool = True,
) -> SimpleNamespace:
    """The fields of an ``OmniEngineCoreRequest`` the producer-side processors read (in vLLM-Omni they run in
    the producer's worker, on its engine request)."""
    return SimpleNamespace(
        status=SimpleNamespace(name="FINISHED_STOPPED" if stopped else "FINISHED_LENGTH_CAPPED"),
        request_id=request_id,
        external_req_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        output_token_ids=list(output_token_ids),
        all_token_ids=[*prompt_token_ids, *output_token_ids],
        additional_information=None,  # the speaker travels in the consumer's prompt (edges.consumer_prompt)
        sampling_params=SimpleNamespace(stop_token_ids=list(stop_token_ids), stop_token_id=None),
        resumable=False,
        num_computed_tokens=len(prompt_token_ids) + len(output_token_ids),
        is_finished=lambda: finished,
    )


def source_view(
    request_id: str,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    text: str = "",
    multimodal_output: Mapping[str, Any] | None = None,
) -> SimpleNamespace:
    """The fields of an upstream ``RequestOutput`` the consumer-side processors read (vLLM-Omni's orchestrator
    hands them the upstream stage's finished output as ``source_outputs``)."""
    completion = SimpleNamespace(
        index=0,
        text=text,
        token_ids=list(output_token_ids),
        cumulative_token_ids=list(output_token_ids),
        multimodal_output=dict(multimodal_output or {}),
        finish_reason="stop",
    )
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        outputs=[completion],
        finished=True,
        multimodal_output=dict(multimodal_output or {}),
    )


def model_config_view(hf_config: Any) -> SimpleNamespace:
    """What processors reach through ``transfer_manager`` (``.config``) and ``._get_model_config()``."""
    config = SimpleNamespace(hf_config=hf_config)
    return SimpleNamespace(config=config, _get_model_config=lambda: config)


# ---------------------------------------------------------------------------
# Runs of chunks: several connector chunks one engine output completed, as one payload
# ---------------------------------------------------------------------------


def as_steps(steps: Sequence[HandoffPayload]) -> HandoffPayload:
    """Consecutive connector chunks as one payload of numbered steps (:func:`split_steps` undoes it)."""
    tensors = {f"{i}/{k}": v for i, step in enumerate(steps) for k, v in step.tensors.items()}
    return HandoffPayload(steps[0].kind, tensors, {"steps": [step.meta for step in steps]})


def merge_steps(first: HandoffPayload, later: HandoffPayload) -> HandoffPayload:
    """Two consecutive runs of chunks as one (a stage coalesces them under load)."""
    return as_steps([*split_steps(first), *split_steps(later)])


def split_steps(chunks: HandoffPayload) -> list[HandoffPayload]:
    """A run of chunks, one payload per connector chunk, in order (a payload without steps: itself)."""
    if "steps" not in chunks.meta:
        return [chunks]
    steps = [HandoffPayload(chunks.kind, {}, meta) for meta in chunks.meta["steps"]]
    for key, value in chunks.tensors.items():
        index, _, name = key.partition("/")
        steps[int(index)].tensors[name] = value
    return steps
