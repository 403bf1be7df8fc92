"""Engine families, imported lazily so a graph only pulls in the libraries it uses.

Each family module exposes ``EngineArgs`` (a pydantic model, cheap to import) and
``create(stage_name, engine_args) -> StageEngine``, and may expose ``input_modalities(args)``
(what an entry stage of the family takes in chat messages; text only if absent) and
``entry_prompt(args)`` (``speech`` for an entry stage that takes the text to speak alone, a TTS
model; ``chat`` if absent); heavy imports happen in ``start()``.
A family that honours some of vLLM's extra sampling parameters
(:data:`omni_serve.types.SAMPLING_EXTENSIONS`) says which in
``honoured_sampling(engine_args) -> frozenset[str]``; without it, it honours none.
A family whose engine can read its upstream's handoff as a stream of chunks (a stage's
``stream_input``) says for which args in ``reads_streamed_input(engine_args) -> bool``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from pydantic import ValidationError

from omni_serve.engines.base import StageEngine
from omni_serve.types import SAMPLING_EXTENSIONS, Modality, SamplingParams

FAMILIES = {
    "transformers": "omni_serve.engines.transformers",
    "vllm": "omni_serve.engines.vllm",
    "vllm_omni": "omni_serve.engines.vllm_omni",
    "diffusers": "omni_serve.engines.diffusers",
    "vllm_omni_diffusion": "omni_serve.engines.vllm_omni_diffusion",
}


def _module(family: str) -> ModuleType:
    return importlib.import_module(FAMILIES[family])


def validate_engine_args(family: str, engine_args: dict[str, Any]) -> str | None:
    """Return a message naming the bad field, or None when the args are valid."""
    try:
        _module(family).EngineArgs.model_validate(engine_args)
    except ValidationError as err:
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
    return None


def honoured_sampling(family: str, engine_args: dict[str, Any]) -> frozenset[str]:
    """The vLLM extra sampling parameters a stage of this family honours (the others must stay at their default)."""
    declared = getattr(_module(family), "honoured_sampling", None)
    return frozenset() if declared is None else declared(engine_args)


def reads_streamed_input(family: str, engine_args: dict[str, Any]) -> bool:
    """Whether a stage of this family, with these args, can read its upstream's handoff as a stream of chunks."""
    declared = getattr(_module(family), "reads_streamed_input", None)
    return bool(declared is not None and declared(engine_args))


def unhonoured_sampling(params: SamplingParams, honoured: frozenset[str]) -> list[str]:
    """The vLLM extra sampling parameters ``params`` sets away from their default that are not ``honoured``."""
    fields = SamplingParams.model_fields
    return [
        name
        for name in SAMPLING_EXTENSIONS
        if name not in honoured and getattr(params, name) != fields[name].get_default(call_default_factory=True)
    ]


def create_engine(family: str, stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    return _module(family).create(stage_name, engine_args)


def entry_prompt(family: str, engine_args: dict[str, Any]) -> str:
    """What an entry stage of the family builds its prompt from with these args: ``chat`` unless the family says
    ``speech`` (the text to speak alone) in ``entry_prompt(args)``."""
    module = _module(family)
    declare = getattr(module, "entry_prompt", None)
    return declare(module.EngineArgs.model_validate(engine_args)) if declare else "chat"


def input_modalities(family: str, engine_args: dict[str, Any]) -> list[Modality]:
    """What the family's engine takes as chat input with these args, text first."""
    module = _module(family)
    declare = getattr(module, "input_modalities", None)
    taken = declare(module.EngineArgs.model_validate(engine_args)) if declare else {Modality.TEXT}
    return [m for m in Modality if m in taken or m is Modality.TEXT]
