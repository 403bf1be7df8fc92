"""The ``transformers`` engine family: Qwen3-Omni stages run by Hugging Face transformers.

One engine serves one stage (thinker, talker or code2wav) of a Qwen3-Omni checkpoint;
``model: tiny`` is the random-weight checkpoint of :mod:`omni_serve.checkpoints.tiny_omni`. It runs
anywhere (CPU included) and is the reference the faster engine families are compared with. This
family runs one model (HF's ``Qwen3OmniMoeForConditionalGeneration``), so its modules are that
model's stages:

- :mod:`.args`: what a stage's ``engine_args`` may say;
- :mod:`.worker`: the worker thread every stage runs its model work on, loading, stats;
- :mod:`.sampling`: HF ``generate`` settings, seeds, end ids and stopping criteria;
- :mod:`.thinker`, :mod:`.talker`, :mod:`.code2wav`: one module per Qwen3-Omni stage, whose engine a stage
  gets by its role (``model_stage``: :func:`engine_for_role`).

Concurrency: each engine runs its model work on one dedicated worker thread, one request
at a time, in arrival order. HF ``generate`` samples from torch's global RNG, so a request
seeds it when its turn comes, and sampling stages of one process share one lock: a
request's draws are a function of its seed alone, whatever else runs. Results travel back
to the event loop with ``call_soon_threadsafe``; the consumer merges whatever has piled up
into one output. torch/transformers are imported in ``start()``, so importing this package
is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_serve.engines.base import StageEngine
from omni_serve.engines.family import Family
from omni_serve.engines.grammar import grammar_available
from omni_serve.engines.transformers.args import TransformersEngineArgs
from omni_serve.engines.transformers.sampling import end_ids
from omni_serve.types import Modality

EngineArgs = TransformersEngineArgs  # the name omni_serve.engines looks up in every family

__all__ = ["EngineArgs", "TransformersEngineArgs", "create", "end_ids", "honoured_sampling", "input_modalities"]


def input_modalities(args: TransformersEngineArgs) -> set[Modality]:
    """The thinker takes images, audio and video through Qwen3-Omni's encoders; the other stages take no chat."""
    return {Modality.TEXT, Modality.IMAGE, Modality.AUDIO, Modality.VIDEO} if args.model_stage == "thinker" else set()


def reads_streamed_input(engine_args: dict[str, Any]) -> bool:
    """The talker reads its thinker's handoff as a stream (``stream_input``); code2wav decodes one chunk a call."""
    return engine_args.get("model_stage") == "talker"


def honoured_sampling(engine_args: dict[str, Any]) -> frozenset[str]:
    """The thinker maps ``ignore_eos``, ``min_p``, ``skip_special_tokens`` and ``logit_bias`` onto HF ``generate``,
    reports ``logprobs`` (:mod:`omni_serve.engines.logprobs`) and, where xgrammar is installed (it comes with
    vLLM), honours ``structured_outputs`` (:mod:`omni_serve.engines.grammar`); the talker ``ignore_eos`` (its
    codec EOS); the talker and code2wav produce no text, so the two parameters that only shape text change
    nothing there."""
    stage = engine_args.get("model_stage")
    if stage == "thinker":
        grammar = {"structured_outputs"} if grammar_available() else set()
        return frozenset({"ignore_eos", "min_p", "skip_special_tokens", "logit_bias", "logprobs", *grammar})
    text_only = {"skip_special_tokens", "spaces_between_special_tokens"}
    return frozenset(text_only | {"ignore_eos"} if stage == "talker" else text_only)


def create(stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    """The engine for ``engine_args['model_stage']``; raises ``pydantic.ValidationError`` on bad args."""
    args = TransformersEngineArgs.model_validate(engine_args)
    return engine_for_role(args.model_stage, stage_name, engine_args)


def engine_for_role(model_stage: str, stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    """The engine of the Qwen3-Omni stage ``model_stage`` (its role: thinker, talker or code2wav), built. The
    stage modules are imported here, when an engine is made, not with the package."""
    from omni_serve.engines.transformers.code2wav import Code2WavEngine
    from omni_serve.engines.transformers.talker import TalkerEngine
    from omni_serve.engines.transformers.thinker import ThinkerEngine

    roles: dict[str, Callable[[str, dict[str, Any]], StageEngine]] = {
        "thinker": ThinkerEngine,
        "talker": TalkerEngine,
        "code2wav": Code2WavEngine,
    }
    return roles[model_stage](stage_name, engine_args)


FAMILY = Family(
    EngineArgs,
    create,
    input_modalities=input_modalities,
    honoured_sampling=honoured_sampling,
    reads_streamed_input=reads_streamed_input,
)
