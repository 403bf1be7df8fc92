"""Why a vLLM-Omni pipeline cannot be served as a graph of stages, read from its declaration and deploy config.

A pipeline is refused with the first reason that holds, the most fundamental first: what it outputs and which
server vLLM-Omni runs it behind (robot policies on its OpenPI socket, realtime video on its video socket,
full-duplex sessions in its duplex orchestrator), then what its stages declare that omni_serve does not run
(classifier-free guidance companions, state kept across chunks, edges that exist only as async chunks with no
way for omni_serve to cut them, KV cache transfer), then the execution kinds it has no engine for. Each reason
names the declaration or deploy field that decides it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_serve.models.vllm_omni import pipelines
from omni_serve.models.vllm_omni.edges import input_processor

# The final outputs an OpenAI route can return.
SERVED_OUTPUTS = ("text", "audio", "image")
ROBOT_ACTIONS = ("action", "actions")


def refusal(declared: Any, deploy: Any) -> str | None:
    """Why pipeline ``declared`` (its ``PipelineConfig``) with ``deploy`` (its merged ``DeployConfig``) cannot
    be served; None if it can."""
    for check in (_outputs, _servers, _entries):
        if (reason := check(declared, deploy)) is not None:
            return reason
    for s in declared.stages:
        for stage_check in (_expands, _retains_state, _kind, _diffusion, _chunked_input):
            if (reason := stage_check(declared, deploy, s)) is not None:
                return f"stage {s.stage_id} ({s.model_stage}){reason}"
    return None


def _outputs(declared: Any, deploy: Any) -> str | None:
    for s in declared.stages:
        if not s.final_output or s.final_output_type in SERVED_OUTPUTS:
            continue
        where = f"stage {s.stage_id} ({s.model_stage}) outputs {s.final_output_type!r}"
        if s.final_output_type in ROBOT_ACTIONS:
            return (
                f"{where}, robot actions: vLLM-Omni serves robot policies on its OpenPI socket "
                "(/v1/realtime/robot/openpi), which has no OpenAI-compatible counterpart"
            )
        if s.final_output_type != "video":  # video: /v1/videos, once a DiT stage draws it (_diffusion)
            return f"{where}: no OpenAI-compatible route"
    return None


def _servers(declared: Any, deploy: Any) -> str | None:
    """The deploy fields that put a pipeline behind one of vLLM-Omni's own sockets instead of the OpenAI API."""
    for ds in deploy.stages:
        extras = ds.engine_extras or {}
        if (extras.get("model_config") or {}).get("policy_server_config"):
            return (
                f"stage {ds.stage_id}'s deploy settings declare a robot policy (model_config.policy_server_config): "
                "vLLM-Omni serves it on its OpenPI socket (/v1/realtime/robot/openpi), which has no "
                "OpenAI-compatible counterpart"
            )
        if extras.get("streaming_output"):
            return (
                f"stage {ds.stage_id}'s deploy settings stream one request's output as an interactive session "
                "(streaming_output: vLLM-Omni's /v1/realtime/video socket); omni_serve serves video as jobs "
                "(/v1/videos)"
            )
    if deploy.session_mode != "turn":
        return (
            f"session_mode {deploy.session_mode!r}: full-duplex sessions run in vLLM-Omni's duplex orchestrator; "
            "omni_serve serves turns"
        )
    return None


def _entries(declared: Any, deploy: Any) -> str | None:
    entries = [s for s in declared.stages if not s.input_sources]
    return None if len(entries) == 1 else f"{len(entries)} entry stages: a graph has exactly one"


def _expands(declared: Any, deploy: Any, s: Any) -> str | None:
    if not s.prompt_expand_func:
        return None
    return (
        " expands each prompt into classifier-free guidance companion requests (prompt_expand_func), which "
        "omni_serve does not run"
    )


def _retains_state(declared: Any, deploy: Any, s: Any) -> str | None:
    if not s.retains_state_across_chunks:
        return None
    return (
        " keeps its state across its input's chunks (retains_state_across_chunks); omni_serve runs each chunk as "
        "an engine request of its own"
    )


def _kind(declared: Any, deploy: Any, s: Any) -> str | None:
    execution = str(getattr(s.execution_type, "value", s.execution_type))
    if execution == pipelines.DIFFUSION or pipelines.kind(s) is not None:
        return None
    return (
        f" is a {execution} stage; the vllm_omni family runs llm_ar and llm_generation stages, the "
        "vllm_omni_diffusion family DiT stages"
    )


def _diffusion(declared: Any, deploy: Any, s: Any) -> str | None:
    """A DiT stage is served alone where its pipeline class has a request mapping (a hook: lone image and video
    DiTs), or where an autoregressive stage feeds it (its declared input processor builds the DiT's request from
    the AR's output) and it draws the image the client gets."""
    if pipelines.family(s) != "vllm_omni_diffusion":
        return None
    if not s.input_sources:
        arch = s.model_arch or declared.model_arch
        mapped: dict[str, set[str]] = {"image": set(pipelines.IMAGE_DITS), "video": set(pipelines.VIDEO_DITS)}
        if arch in mapped.get(s.final_output_type, set()):
            return None
        return (
            f" is a lone diffusion stage ({arch}, making {s.final_output_type}) with no request mapping yet: lone "
            "DiTs are served by their pipeline class's hooks (pipelines.IMAGE_DITS, pipelines.VIDEO_DITS)"
        )
    upstream = [declared.get_stage(i) for i in s.input_sources]
    finals = {t.final_output_type for t in declared.stages if t.final_output}
    if any(pipelines.kind(u) != "autoregressive" for u in upstream) or finals != {"image"}:
        return (
            " is a diffusion stage; generated graphs run a DiT stage fed by an autoregressive stage, answering "
            "images only"
        )
    if (s.omni_kv_config or {}).get("need_recv_cache"):
        return (
            " is a diffusion stage that reads its upstream's KV cache (omni_kv_config: vLLM-Omni's KV transfer "
            "between stages), which omni_serve's handoffs do not carry"
        )
    if input_processor(s) is None:
        return " is a diffusion stage with no input processor to build its request from its upstream"
    return None


def _chunked_input(declared: Any, deploy: Any, s: Any) -> str | None:
    """An input that reaches ``s`` only as async chunks (its producer declares no whole handoff, ``s`` no whole-input
    processor) is served where omni_serve knows how ``s`` reads chunks: a decoder with its left context cut
    (hooks ``frame_geometry``, ``decoder_cuts_left_context``), an autoregressive stage with a streamed prompt
    (hook ``chunk_prompt``)."""
    if len(s.input_sources) != 1:
        return None
    producer = declared.get_stage(s.input_sources[0])
    if not producer.async_chunk_process_next_stage_input_func or producer.custom_process_next_stage_input_func:
        return None
    if input_processor(s) is not None:
        return None
    edge = f"'s input from stage {producer.stage_id} exists only as async chunks ({producer.model_stage}'s "
    if not async_chunks_on(deploy, producer, s):
        return edge + "async_chunk_process_next_stage_input_func), and the deploy config turns async chunks off"
    reads: dict[str, Callable[[Any], bool]] = {
        "generation": lambda h: h.frame_geometry is not None or h.decoder_cuts_left_context,
        "autoregressive": lambda h: h.chunk_prompt is not None,
    }
    hooks = pipelines.hooks(declared.model_type).stage(s.model_stage)
    if reads[pipelines.kind(s) or "generation"](hooks):
        return None
    hook = "frame_geometry or decoder_cuts_left_context" if pipelines.kind(s) == "generation" else "chunk_prompt"
    return edge + f"processor), and omni_serve does not know how it reads them yet (hook {hook})"


def async_chunks_on(deploy: Any, *stages: Any) -> bool:
    """Whether the deploy config turns async chunks on for every one of ``stages`` (vLLM-Omni's rule)."""
    from vllm_omni.config import stage_config as sc

    by_id = {ds.stage_id: ds for ds in deploy.stages}
    return all(sc.resolve_stage_async_chunk(deploy, by_id.get(s.stage_id)) for s in stages)
