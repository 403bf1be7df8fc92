"""Qwen3-Omni and Qwen2.5-Omni: what their vLLM-Omni declarations do not say (hooks, :mod:`.hooks`).

Each place, and why the declaration is not enough:

- **Thinker payload rows** (:func:`keep_computed_rows`): ``thinker2talker_full_payload`` drops the last
  accumulated row, assuming it belongs to the final sampled token (true with async scheduling, which
  vLLM-Omni runs Qwen3-Omni with); vLLM's CPU platform schedules synchronously and never computes it.
- **Thinker step rows**: its async-chunk processor reads the captured hidden-state layers step by step
  (``hidden_states.layers``), not codec frames.
- **Talker codes** (``generated_rows_only``, Qwen3-Omni's): its engine holds an all-zero placeholder row per prompt
  position in ``codes.audio``; ``talker2code2wav_full_payload`` aligns rows from the end, so with
  synchronous scheduling (one frame fewer than tokens) a placeholder would be taken for a frame.
- **Talker steps** (``extra_steps``, Qwen3-Omni's): a codec frame's residual code groups come with the next step, so
  the last sampled token never gets a frame; one more step yields ``max_tokens`` whole frames.
- **Streamed talker input**: its placeholder prompt is sized from chunk 0 as vLLM-Omni's async-chunk
  prewarm sizes it (``compute_talker_prompt_ids_length``); a thinker's whole handoff is turned into
  the chunks streaming would have sent; the decode row is cast to the talker's dtype (vLLM-Omni's
  decode step projects it uncast; on GPUs both stages run bf16, on CPU the thinker runs float32).
- **Code2wav frames**: 16 code groups, ``prod(upsample_rates) * prod(upsampling_ratios)`` samples a
  frame (its ``code2wav_config``), and the samples a lone decode holds back, measured at start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from omni_serve.models.vllm_omni.edges import PROCESSORS, ChunkTransfer, function, kind
from omni_serve.models.vllm_omni.hooks import FrameGeometry, PipelineHooks, StageHooks, StepRows
from omni_serve.models.vllm_omni.payload import as_steps, from_handoff
from omni_serve.payload import HandoffPayload

THINKER_CHUNKS = PROCESSORS + "qwen3_omni.thinker2talker_async_chunk"


def keep_computed_rows(payload: Any, flat: Mapping[str, Any], hf_config: Any, num_tokens: int) -> None:
    """Undo ``thinker2talker_full_payload``'s drop of the last hidden-state row when that row was never computed.

    With synchronous scheduling the final token never runs, so the engine holds ``num_tokens - 1`` rows
    and the drop would cut the last real token's row: the payload then keeps every computed row, as
    transformers' ``generate`` hands on every row it computed. (Upstream runs Qwen3-Omni with async
    scheduling only; no upstream issue found for this.)
    """
    accept = getattr(getattr(hf_config, "talker_config", None), "accept_hidden_layer", None)
    if accept is None or not isinstance(payload, dict):
        return
    embed, hidden = flat.get("hidden_states.layer_0"), flat.get(f"hidden_states.layer_{accept}")
    if embed is None or hidden is None or not all(t.shape[0] == num_tokens - 1 for t in (embed, hidden)):
        return
    payload["embed"]["prefill"] = embed.detach().cpu()
    payload["hidden_states"]["output"] = hidden.detach().cpu()


def whole_as_chunks(whole: HandoffPayload, hf_config: Any) -> HandoffPayload:
    """A thinker's whole handoff as the async chunks streaming sends: what a talker built for streamed input
    reads when its thinker handed over whole (stop strings, or a caller with a finished handoff)."""
    payload = from_handoff(whole)
    accept = int(hf_config.talker_config.accept_hidden_layer)
    embed = payload["embed"]
    layers = {0: embed["prefill"], accept: payload["hidden_states"]["output"]}
    tts = {k: v for k, v in embed.items() if k.startswith("tts_")}
    transfer = ChunkTransfer(
        function(THINKER_CHUNKS),
        kind(THINKER_CHUNKS),
        "whole",
        list(whole.meta["prompt_token_ids"]),
        hf_config,
        {},
        THINKER.step_rows,
    )
    chunks = transfer.push({"hidden_states": {"layers": layers}, "embed": tts}, whole.meta["output_token_ids"], True)
    if not chunks:
        raise ValueError(f"{whole.kind}: no rows to speak")
    return as_steps(chunks)


def talker_chunk_prompt(first: HandoffPayload) -> dict[str, Any]:
    """A streamed talker's placeholder prompt, from the thinker's chunk 0, as vLLM-Omni's async-chunk prewarm
    sizes it (``compute_talker_prompt_ids_length`` of the thinker's prompt); the chunks bring the rest."""
    from vllm_omni.distributed.omni_connectors.adapter import compute_talker_prompt_ids_length

    prompt_ids = [int(i) for i in first.tensors.get("ids.prompt", ())]
    if not prompt_ids:
        raise ValueError(f"{first.kind}: the first chunk carries no prompt ids (ids.prompt)")
    return {"prompt_token_ids": [0] * max(1, compute_talker_prompt_ids_length(prompt_ids))}


def cast_decode_row(payload: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """vLLM-Omni's async-chunk decode step projects the thinker's row without casting it to the talker's dtype
    (its prefill casts the thinker's states itself); on GPUs both stages run bf16, here the thinker runs
    float32. No upstream issue found."""
    decode = payload.get("embed", {}).get("decode")
    if decode is not None:
        payload["embed"]["decode"] = decode.to(dtype)
    return payload


def code2wav_frames(hf_config: Any) -> FrameGeometry | None:
    config = getattr(hf_config, "code2wav_config", None)
    if config is None:
        return None
    samples = math.prod(config.upsample_rates) * math.prod(config.upsampling_ratios)
    return FrameGeometry(code_groups=int(config.num_quantizers), samples_per_frame=int(samples))


THINKER = StageHooks(step_rows=StepRows(rows=("hidden_states.layers",)), fix_payload=keep_computed_rows)
TALKER = StageHooks(
    generated_rows_only=("codes.audio",),
    extra_steps=1,
    chunk_prompt=talker_chunk_prompt,
    whole_as_chunks=whole_as_chunks,
    chunk_payload=cast_decode_row,
)

QWEN3_OMNI = PipelineHooks(
    stages={
        "thinker": THINKER,
        "talker": TALKER,
        "code2wav": StageHooks(frame_geometry=code2wav_frames, measure_decode_lag=True),
    },
    tool_call_parser="hermes",  # Qwen's <tool_call> JSON syntax
    reference_model="Qwen/Qwen3-Omni-30B-A3B-Instruct",
    voice_aliases={
        **dict.fromkeys(["alloy", "coral", "marin", "nova", "sage", "shimmer"], "chelsie"),
        **dict.fromkeys(["ash", "cedar", "echo", "onyx", "verse"], "ethan"),
        **dict.fromkeys(["ballad", "fable"], "aiden"),
    },
    # The thinker on a big GPU's node type, talker and code2wav sharing a smaller one's (cluster.yaml).
    node_resources={"thinker": "omni_gpu_big", "talker": "omni_gpu_shared", "code2wav": "omni_gpu_shared"},
)
QWEN2_5_OMNI = PipelineHooks(
    stages={
        # Its talker samples one codec id a step, carried as its output token ids (talker2code2wav_full_payload):
        # no placeholder rows, no residual groups a step late.
        "thinker": StageHooks(fix_payload=keep_computed_rows),
        # vLLM-Omni's Qwen2.5-Omni speaks Chelsie whatever a request asks: its talker keeps the voice of its first
        # forward (``voice_type``, "temporal hack" in qwen2_5_omni.py) and its code2wav's default is Chelsie.
        "talker": StageHooks(speakers=("chelsie",)),
    },
    tool_call_parser="hermes",  # Qwen's <tool_call> JSON syntax
    reference_model="Qwen/Qwen2.5-Omni-7B",
    # Its one voice (above): an OpenAI client must name one, so each of OpenAI's is Chelsie.
    voice_aliases=dict.fromkeys(
        "alloy ash ballad cedar coral echo fable marin nova onyx sage shimmer verse".split(),
        "chelsie",
    ),
)
