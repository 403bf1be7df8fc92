"""The ``vllm_omni`` engine family: one vLLM-Omni 0.30 pipeline stage per Serve replica (GPU production path).

vLLM-Omni normally runs every stage of a model under one orchestrator. Here a replica builds exactly
one stage's engine the way vLLM-Omni's ``StageRuntime`` builds each of its stages, from the stage's
declaration in its pipeline (``StagePipelineConfig``, :mod:`omni_serve.models.vllm_omni.pipelines`):
the engine kind comes from its ``execution_type``, never from a model or role name.

- :mod:`.engine`: what every kind shares: the EngineCore process, its client, the output pump, one
  engine request, abort, health, stats, the handoff out (the stage's declared producer processors);
- :mod:`.autoregressive`: ``llm_ar`` stages: a prompt (an entry stage's chat or text to speak, else its
  upstream's handoff) -> text and/or a handoff, whole or in chunks;
- :mod:`.generation`: ``llm_generation`` stages: a handoff (codec frames) -> audio in one step;
- :mod:`.prompts`: an entry stage's prompt; :mod:`.streamed`: a stage reading its upstream's async
  chunks through its EngineCore's connector;
- :mod:`.args`: the engine args and the stage config vLLM-Omni's merge builds from them;
  :mod:`.mapping`: pure conversions (sampling, multimodal outputs).

Handoffs run the pipeline's own stage input processors (:mod:`omni_serve.models.vllm_omni.edges`).
Importing this package is cheap (graphs are validated with :class:`EngineArgs`); vLLM and vLLM-Omni
are imported when an engine is made.
"""

from __future__ import annotations

from typing import Any

from omni_serve.engines.base import StageEngine
from omni_serve.engines.family import Family
from omni_serve.engines.vllm_omni.args import EngineArgs, stage_config
from omni_serve.types import SAMPLING_EXTENSIONS, Modality

__all__ = [
    "EngineArgs",
    "create",
    "entry_prompt",
    "honoured_sampling",
    "input_modalities",
    "reads_streamed_input",
    "stage_config",
]


def create(stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    """The engine of the stage's declared execution type; raises ``pydantic.ValidationError`` on bad args and
    ``ValueError`` for a stage the family does not run (an unknown pipeline or stage, a diffusion stage)."""
    from omni_serve.engines.vllm_omni.autoregressive import AutoregressiveEngine
    from omni_serve.engines.vllm_omni.generation import GenerationEngine
    from omni_serve.models.vllm_omni import pipelines

    args = EngineArgs.model_validate(engine_args)
    try:
        declared = pipelines.stage(args.pipeline, args.stage_id)
    except KeyError as err:
        raise ValueError(f"stage {stage_name}: {err.args[0]}") from None
    kinds = {"autoregressive": AutoregressiveEngine, "generation": GenerationEngine}
    kind = pipelines.kind(declared)
    if kind is None:
        raise ValueError(
            f"stage {stage_name}: pipeline {args.pipeline!r} stage {args.stage_id} ({declared.model_stage}) is a "
            f"{declared.execution_type.value} stage, which the vllm_omni family does not run"
        )
    return kinds[kind](stage_name, engine_args)


def honoured_sampling(engine_args: dict[str, Any]) -> frozenset[str]:
    """Every stage is a vLLM engine: vLLM's own extra sampling parameters pass through (mapping)."""
    return frozenset(SAMPLING_EXTENSIONS)


def reads_streamed_input(engine_args: dict[str, Any]) -> bool:
    """Any stage may read its upstream's async chunks as far as the graph can tell (reading the declaration is
    heavy): the engine checks at start that its upstream declares an async-chunk processor and that it is an
    autoregressive stage (``VllmOmniEngine.check_declaration``)."""
    return True


def entry_prompt(args: EngineArgs) -> str:
    """``speech`` for a TTS entry stage, ``image`` for an AR stage planning for a DiT (``engine_args.entry``), else
    ``chat``."""
    return args.entry


def input_modalities(args: EngineArgs) -> set[Modality]:
    """Text, and the media the graph lets an entry stage's chat messages carry (``media``)."""
    return {Modality.TEXT, *(Modality(m) for m in args.media)}


FAMILY = Family(
    EngineArgs,
    create,
    input_modalities=input_modalities,
    entry_prompt=entry_prompt,
    honoured_sampling=honoured_sampling,
    reads_streamed_input=reads_streamed_input,
)
