"""What a ``vllm_omni`` stage's ``engine_args`` may say, and the vLLM-Omni stage config built from them.

A stage names its pipeline and its stage id; everything the pipeline declares about that stage
(execution type, inputs, final output, processors, sampling constraints, worker and scheduler) comes
from vLLM-Omni's ``StagePipelineConfig``, merged with the stage's deploy settings (``engine``) by
vLLM-Omni's own ``merge_pipeline_deploy`` (:func:`stage_config`). Cheap to import (pydantic only):
graphs are validated with :class:`EngineArgs` before any engine library loads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.models.tool_calls import tool_call_parser_field
from omni_serve.pacing import engine_config, min_step_field

# Deploy keys a stage's ``engine`` may not set, and why: the pipeline declares them, or omni_serve owns them.
NOT_DEPLOY_KEYS = {
    "devices": "Ray assigns GPUs to the replica",
    "model": "use engine_args.model",
    "model_stage": "the pipeline declares it",
    "worker_type": "the pipeline declares it (the stage's execution_type)",
    "scheduler_cls": "the pipeline declares it (the stage's execution_type and async_scheduling)",
    "hf_config_name": "the pipeline declares it",
    "final_output": "the pipeline declares it",
    "custom_process_input_func": "the pipeline declares it",
    "custom_process_next_stage_input_func": "the pipeline declares it",
    "async_chunk": "the receiving stage's stream_input turns it on (set that instead)",
    "requires_full_payload_input": "stages run without connectors: the replica hands the payload in",
    "stage_connector_spec": "stages run without connectors between them",
}


class EngineArgs(BaseModel):
    """One vLLM-Omni stage: its pipeline's declaration, plus the deploy settings in ``engine``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="HF model id or local path of the whole checkpoint; 'tiny' (or a registered tiny checkpoint's "
        "name) is built locally (omni_serve.checkpoints)."
    )
    pipeline: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="vLLM-Omni pipeline: its key in vllm_omni.config.pipeline_registry.OMNI_PIPELINES (e.g. "
        "qwen3_omni_moe). Its declaration builds this stage.",
    )
    stage_id: int = Field(ge=0, description="This stage's id in the pipeline.")
    entry: Literal["chat", "speech", "image"] = Field(
        "chat",
        description="Entry stage: what it builds its prompt from: a chat conversation (the checkpoint's chat "
        "template; text to speak is teacher-forced as the assistant's reply), the text to speak alone (a TTS "
        "model's prompt), or an image request (an AR stage planning for a DiT: prompt, size, seed, the image to "
        "edit; vLLM-Omni's images API's prompt). The graph's routes follow it.",
    )
    media: list[Literal["image", "audio", "video"]] = Field(
        default_factory=list,
        description="Entry stage: the media a chat message may carry (the stage's multimodal processor takes them).",
    )
    sampling_constraints: dict[str, Any] = Field(
        default_factory=dict,
        description="Sampling fields forced on every request, over the stage's declared constraints (e.g. a "
        "checkpoint whose codec stop token differs from the declared one).",
    )
    chunks: dict[str, Any] | None = Field(
        None,
        description="Hand the output downstream in chunks, cut by the stage's declared async-chunk processor: the "
        "connector settings it reads (vLLM-Omni's connector `extra`, e.g. codec_chunk_frames, "
        "codec_left_context_frames, initial_codec_chunk_frames). Each chunk is its own call of the downstream stage.",
    )
    tool_call_parser: str | None = tool_call_parser_field()  # an entry stage whose output is text only
    min_step_s: float = min_step_field()  # omni_serve.pacing; paced in the stage's CPU worker (omni_serve.platforms)
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="The stage's vLLM-Omni deploy settings (a deploy YAML's stage entry: max_num_seqs, "
        "gpu_memory_utilization, max_model_len, dtype, ...).",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineArgs:
        for key, why in NOT_DEPLOY_KEYS.items():
            if key in self.engine:
                raise ValueError(f"engine.{key} is not allowed: {why}")
        tp = int(self.engine.get("tensor_parallel_size") or 1)
        if tp > 1 and self.engine.get("distributed_executor_backend") != "mp":
            raise ValueError(
                f"engine.distributed_executor_backend: tensor_parallel_size={tp} inside a Serve replica needs 'mp' "
                "(the Ray executor loses the replica's placement group)"
            )
        return self


# Engine args vLLM-Omni's merge emits for a stage that the stage runs without here: the producer-side
# processor runs in the replica (omni_serve.models.vllm_omni.edges), not in the worker; the inline
# diffusion flag is read only by its diffusion stage runtime.
STANDALONE_DROPPED = ("custom_process_next_stage_input_func", "inline_diffusion")


def stage_config(args: EngineArgs, stream_input: bool = False) -> Any:
    """This stage's vLLM-Omni ``StageConfig``, built by vLLM-Omni's ``merge_pipeline_deploy`` from the pipeline's
    declaration and ``args.engine`` as the stage's deploy entry (``.to_omegaconf()`` is what its engine builders take).

    Each stage runs standalone, without connectors (the object store carries handoffs): no payload waits
    on a connector (``requires_full_payload_input`` off) and no async chunks, except that a stage with
    ``stream_input`` reads its upstream's chunks as vLLM-Omni's async-chunk mode does, its EngineCore
    taking them from a shared-memory connector as a receiver only (the replica writes them there,
    :mod:`omni_serve.engines.vllm_omni.streamed`). ``min_step_s`` reaches the stage's worker in the engine
    config's ``additional_config``.
    """
    from vllm_omni.config import stage_config as sc

    from omni_serve.models.vllm_omni import pipelines

    # One deploy entry parsed as vLLM-Omni parses each entry of a deploy YAML (private: its only parser of one).
    entry = sc._parse_stage_deploy({"stage_id": args.stage_id, **args.engine})
    deploy = sc.DeployConfig(async_chunk=False, stages=[entry])
    merged = sc.merge_pipeline_deploy(pipelines.pipeline(args.pipeline), deploy)
    (config,) = [c for c in merged if c.stage_id == args.stage_id]
    engine = config.yaml_engine_args
    for key in STANDALONE_DROPPED:
        engine.pop(key, None)
    engine["requires_full_payload_input"] = False
    if stream_input:
        engine["async_chunk"] = True
        engine["stage_connector_spec"] = {"name": "SharedMemoryConnector", "extra": {"role": "receiver"}}
    if args.min_step_s:
        engine["additional_config"] = engine_config(args.min_step_s, engine.get("additional_config"))
    config.sampling_constraints = {**config.sampling_constraints, **args.sampling_constraints}
    # The replica builds every request's sampling itself (mapping.vllm_sampling_params): no defaults here.
    config.yaml_extras["default_sampling_params"] = {}
    return config
