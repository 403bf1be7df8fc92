"""What a ``vllm_omni`` stage's ``engine_args`` may say, and the vLLM-Omni stage config built from them.

Cheap to import (pydantic only): graphs are validated with it before any engine library loads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.models.tool_calls import tool_call_parser_field
from omni_serve.pacing import engine_config, min_step_field


class CodecChunkArgs(BaseModel):
    """Codec streaming talker -> code2wav, as vLLM-Omni's async-chunk connector does it."""

    model_config = ConfigDict(extra="forbid")

    chunk_frames: int = Field(25, ge=1, description="Frames per codec chunk.")
    left_context_frames: int = Field(25, ge=0, description="Frames of left context each chunk carries.")
    initial_chunk_frames: int = Field(0, ge=0, description="Smaller first chunk (0 = same size), cuts time to audio.")


class EngineArgs(BaseModel):
    """One vLLM-Omni stage. ``engine`` is passed to vLLM-Omni's engine-args builder as is."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="HF model id or local path of the whole omni checkpoint; 'tiny' is omni_serve's tiny Qwen3-Omni."
    )
    pipeline: Literal["qwen3_omni_moe", "qwen2_5_omni"] = Field(
        description="vLLM-Omni pipeline model_type; picks the stage input processors."
    )
    stage_id: int = Field(ge=0, description="This stage's id in the vLLM-Omni pipeline.")
    model_stage: Literal["thinker", "talker", "code2wav"] = Field(description="vLLM-Omni model_stage.")
    engine_input_source: list[int] = Field(default_factory=list, description="Upstream stage ids (topology).")
    final_output_type: Literal["text", "audio"] | None = Field(None, description="What a final stage emits.")
    is_comprehension: bool = Field(False, description="Stage owns the tokenizer (thinker).")
    requires_multimodal_data: bool = Field(False, description="Stage consumes multimodal inputs.")
    custom_process_input_func: str | None = Field(None, description="vLLM-Omni consumer-side processor path.")
    sampling_constraints: dict[str, Any] = Field(
        default_factory=dict, description="Sampling fields forced on every request (e.g. the talker's stop token)."
    )
    codec_chunk: CodecChunkArgs | None = Field(None, description="Talker only: stream codec chunks to code2wav.")
    tool_call_parser: str | None = tool_call_parser_field()
    min_step_s: float = min_step_field()  # omni_serve.pacing; paced in the stage's CPU worker (omni_serve.platforms)
    engine: dict[str, Any] = Field(
        default_factory=dict, description="vLLM-Omni stage engine args (OmniEngineArgs fields, worker/scheduler)."
    )

    @model_validator(mode="after")
    def _check(self) -> EngineArgs:
        for key in ("devices", "model", "model_stage"):
            if key in self.engine:
                why = "Ray assigns GPUs to the replica" if key == "devices" else f"use engine_args.{key}"
                raise ValueError(f"engine.{key} is not allowed: {why}")
        if self.engine.get("async_chunk"):  # a talker fed whole handoffs would wait for chunks that never come
            raise ValueError("engine.async_chunk: the receiving stage's stream_input turns it on (set that instead)")
        tp = int(self.engine.get("tensor_parallel_size") or 1)
        if tp > 1 and self.engine.get("distributed_executor_backend") != "mp":
            raise ValueError(
                f"engine.distributed_executor_backend: tensor_parallel_size={tp} inside a Serve replica needs 'mp' "
                "(the Ray executor loses the replica's placement group)"
            )
        if self.tool_call_parser is not None and self.model_stage != "thinker":
            raise ValueError("tool_call_parser: only the thinker parses tool calls from its output")
        if self.codec_chunk is not None and (self.model_stage != "talker" or self.pipeline != "qwen3_omni_moe"):
            raise ValueError("codec_chunk: only the qwen3_omni_moe talker streams codec chunks")
        return self


def stage_config(args: EngineArgs, stream_input: bool = False) -> dict[str, Any]:
    """This stage in vLLM-Omni's per-stage config shape (what ``StageConfig.to_omegaconf`` yields).

    ``min_step_s`` reaches the stage's worker in the engine config's ``additional_config``.
    ``stream_input``: the stage reads its upstream's chunks as vLLM-Omni's async-chunk mode does; its
    EngineCore takes them from a shared-memory connector as a receiver only (the replica writes them
    there, :mod:`omni_serve.engines.vllm_omni.talker`; its own outputs leave through the replica).
    """
    final = args.final_output_type is not None
    engine = {**args.engine, "model_stage": args.model_stage, "final_output": final}
    if stream_input:
        engine["async_chunk"] = True
        engine.setdefault("stage_connector_spec", {"name": "SharedMemoryConnector", "extra": {"role": "receiver"}})
    if args.min_step_s:
        engine["additional_config"] = engine_config(args.min_step_s, args.engine.get("additional_config"))
    return {
        "stage_id": args.stage_id,
        "stage_type": "llm",
        "engine_args": engine,
        "runtime": {"process": True, "requires_multimodal_data": args.requires_multimodal_data},
        "engine_input_source": list(args.engine_input_source),
        "final_output": final,
        "final_output_type": args.final_output_type,
        "is_comprehension": args.is_comprehension,
        "sampling_constraints": dict(args.sampling_constraints),
        "default_sampling_params": {},
        **({"custom_process_input_func": args.custom_process_input_func} if args.custom_process_input_func else {}),
    }
