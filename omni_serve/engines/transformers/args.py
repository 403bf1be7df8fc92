"""What a ``transformers`` stage's ``engine_args`` may say (pydantic only: cheap to import)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.models.tool_calls import tool_call_parser_field
from omni_serve.pacing import min_step_field


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
