"""Engine families, imported lazily so a graph only pulls in the libraries it uses.

Each family module exposes ``EngineArgs`` (a pydantic model, cheap to import) and
``create(stage_name, engine_args) -> StageEngine``; heavy imports happen in ``start()``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from pydantic import ValidationError

from omni_serve.engines.base import StageEngine

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


def create_engine(family: str, stage_name: str, engine_args: dict[str, Any]) -> StageEngine:
    return _module(family).create(stage_name, engine_args)
