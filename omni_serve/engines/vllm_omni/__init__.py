"""The ``vllm_omni`` engine family: one vLLM-Omni 0.30 stage engine per Serve replica (GPU production path).

vLLM-Omni normally runs every stage of a model under one orchestrator. Here a replica builds
exactly one stage's engine the way vLLM-Omni's ``StageRuntime`` builds each of its stages; the
plumbing every stage shares (EngineCore process, client, output pump, one engine request, abort,
health, stats) is :mod:`.engine`, and each ``model_stage`` is a role class on top of it, chosen
once in :func:`create`:

- :mod:`.thinker`: chat messages (and media) -> text deltas, then the thinker -> talker handoff;
- :mod:`.talker`: that handoff -> codec frames, in chunks for code2wav;
- :mod:`.code2wav`: codec frames -> 24 kHz audio.

:mod:`.args` holds the engine args and the stage config built from them, :mod:`.mapping` the
pure conversions (sampling, prompts, multimodal outputs); handoffs reuse vLLM-Omni's stage input
processors (:mod:`omni_serve.models.vllm_omni_handoffs`). Importing this package is cheap (the
graph is validated with :class:`EngineArgs`); vLLM and vLLM-Omni are imported when an engine starts.
"""

from __future__ import annotations

from typing import Any

from omni_serve.engines.base import StageEngine, engine_for_role
from omni_serve.engines.vllm_omni.args import CodecChunkArgs, EngineArgs, stage_config
from omni_serve.types import SAMPLING_EXTENSIONS, Modality

__all__ = [
    "CodecChunkArgs",
    "EngineArgs",
    "create",
    "honoured_sampling",
    "input_modalities",
    "reads_streamed_input",
    "stage_config",
]


def create(stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    """The role class of ``engine_args['model_stage']``; raises ``pydantic.ValidationError`` on bad args."""
    from omni_serve.engines.vllm_omni.code2wav import Code2WavEngine
    from omni_serve.engines.vllm_omni.talker import TalkerEngine
    from omni_serve.engines.vllm_omni.thinker import ThinkerEngine

    args = EngineArgs.model_validate(engine_args)
    roles = {"thinker": ThinkerEngine, "talker": TalkerEngine, "code2wav": Code2WavEngine}
    return engine_for_role(roles, args.model_stage, stage_name, engine_args)


def honoured_sampling(engine_args: dict[str, Any]) -> frozenset[str]:
    """Every stage is a vLLM engine: vLLM's own extra sampling parameters pass through (mapping)."""
    return frozenset(SAMPLING_EXTENSIONS)


def reads_streamed_input(engine_args: dict[str, Any]) -> bool:
    """The Qwen3-Omni talker reads its thinker's handoff as vLLM-Omni's async chunks (``stream_input``)."""
    return engine_args.get("model_stage") == "talker" and engine_args.get("pipeline") == "qwen3_omni_moe"


def input_modalities(args: EngineArgs) -> set[Modality]:
    """Both pipelines' thinkers take images, audio and video; the other stages take no chat."""
    return {Modality.TEXT, Modality.IMAGE, Modality.AUDIO, Modality.VIDEO} if args.model_stage == "thinker" else set()
