"""Engine families, imported lazily so a graph only pulls in the libraries it uses.

Each family module declares itself once, in its ``FAMILY`` (:class:`omni_serve.engines.family.Family`):
its args model, how its engine is created, and its capabilities (what an entry stage takes and builds its
prompt from, which of vLLM's extra sampling parameters it honours, whether it reads streamed input).
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import ValidationError

from omni_serve.engines.base import StageEngine
from omni_serve.engines.family import Family
from omni_serve.types import SAMPLING_EXTENSIONS, Modality, SamplingParams

FAMILIES = {
    "transformers": "omni_serve.engines.transformers",
    "vllm": "omni_serve.engines.vllm",
    "vllm_omni": "omni_serve.engines.vllm_omni",
    "diffusers": "omni_serve.engines.diffusers",
    "vllm_omni_diffusion": "omni_serve.engines.vllm_omni.diffusion",
}


def _family(family: str) -> Family:
    declared: Family = importlib.import_module(FAMILIES[family]).FAMILY
    return declared


def validate_engine_args(family: str, engine_args: dict[str, Any]) -> str | None:
    """Return a message naming the bad field, or None when the args are valid."""
    try:
        _family(family).engine_args.model_validate(engine_args)
    except ValidationError as err:
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
    return None


def honoured_sampling(family: str, engine_args: dict[str, Any]) -> frozenset[str]:
    """The vLLM extra sampling parameters a stage of this family honours (the others must stay at their default)."""
    return _family(family).honoured_sampling(engine_args)


def reads_streamed_input(family: str, engine_args: dict[str, Any]) -> bool:
    """Whether a stage of this family, with these args, can read its upstream's handoff as a stream of chunks."""
    return _family(family).reads_streamed_input(engine_args)


def unhonoured_sampling(params: SamplingParams, honoured: frozenset[str]) -> list[str]:
    """The vLLM extra sampling parameters ``params`` sets away from their default that are not ``honoured``."""
    fields = SamplingParams.model_fields
    return [
        name
        for name in SAMPLING_EXTENSIONS
        if name not in honoured and getattr(params, name) != fields[name].get_default(call_default_factory=True)
    ]


def create_engine(family: str, stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    return _family(family).create(stage_name, engine_args)


def entry_prompt(family: str, engine_args: dict[str, Any]) -> str:
    """What an entry stage of the family builds its prompt from with these args: ``chat`` unless the family says
    ``speech`` (the text to speak alone) in ``entry_prompt(args)``."""
    declared = _family(family)
    return declared.entry_prompt(declared.engine_args.model_validate(engine_args))


def input_modalities(family: str, engine_args: dict[str, Any]) -> list[Modality]:
    """What the family's engine takes as chat input with these args, text first."""
    declared = _family(family)
    taken = declared.input_modalities(declared.engine_args.model_validate(engine_args))
    return [m for m in Modality if m in taken or m is Modality.TEXT]
