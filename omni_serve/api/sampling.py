"""Each stage's sampling for one request: the graph's defaults, then what the client sent.

Order: a stage's ``default_sampling`` from the graph, then the request's top-level fields (the entry
stage; ``seed`` goes to every stage, so one client seed makes the whole graph reproducible), then
per-stage overrides: ``stage_sampling`` by stage name, or vLLM-Omni's ``sampling_params_list`` by
stage position (the graph's stage order). A value the stage's engine cannot honour (one of vLLM's
extra sampling parameters, away from its default) is a 400 naming the field as the client sent it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from omni_serve.api.openai.errors import bad_request, from_validation
from omni_serve.api.openai.sampling import SamplingRequest
from omni_serve.engines import honoured_sampling, unhonoured_sampling
from omni_serve.graph.config import GraphConfig
from omni_serve.types import SamplingParams

# vLLM SamplingParams' ``detokenize`` decides only whether vLLM reports text for a stage; accepted in
# stage_sampling / sampling_params_list entries (vLLM-Omni's example client sends it), ignored.
_VLLM_REPORTING_FIELDS = frozenset({"detokenize"})


def sampling_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """One stage's overrides as the client sent them (our names, or vLLM SamplingParams' names) -> ours.

    vLLM's ``top_k: -1`` (no top-k filtering) is our 0; other unknown fields are kept, so that
    validation refuses them by name.
    """
    overrides = {k: v for k, v in values.items() if k not in _VLLM_REPORTING_FIELDS}
    if overrides.get("top_k") == -1:
        overrides["top_k"] = 0
    return overrides


class StageSampling:
    """Resolves the per-stage sampling of requests to one graph."""

    def __init__(self, graph: GraphConfig):
        self.graph = graph
        self.names = [s.name for s in graph.stages]
        self.honoured = {s.name: honoured_sampling(s.engine, s.engine_args) for s in graph.stages}

    def defaults(self, seed: int | None = None) -> dict[str, SamplingParams]:
        """Every stage's default sampling, with the client's seed (if any) in each."""
        defaults = {s.name: s.default_sampling for s in self.graph.stages}
        if seed is None:
            return defaults
        return {name: params.model_copy(update={"seed": seed}) for name, params in defaults.items()}

    def for_request(self, body: SamplingRequest) -> dict[str, SamplingParams]:
        """Each stage's sampling for a validated request (chat completions, or another route's sampling fields).

        A value out of bounds is a 400 naming the field as the client sent it (``stage_sampling.talker.max_tokens``).
        """
        entry = self.graph.entry.name
        top_level = body.entry_sampling()
        per_stage, where = self._per_stage(body)
        resolved: dict[str, SamplingParams] = {}
        for stage in self.graph.stages:
            values = stage.default_sampling.model_dump()
            sent_as: dict[str, str] = {}  # field -> the prefix of its path in the request
            if stage.name == entry:
                values.update(top_level)
                sent_as.update(dict.fromkeys(top_level, ""))
            elif body.seed is not None:
                values["seed"] = body.seed
            overrides = sampling_overrides(per_stage.get(stage.name, {}))
            values.update(overrides)
            sent_as.update(dict.fromkeys(overrides, f"{where[stage.name]}."))
            try:
                resolved[stage.name] = params = SamplingParams.model_validate(values)
            except ValidationError as err:
                api_err = from_validation(err)
                prefix = sent_as.get((api_err.param or "").split(".")[0], f"{where[stage.name]}.")
                api_err.param = f"{prefix}{api_err.param}"
                api_err.message = f"{prefix}{api_err.message}"
                raise api_err from None
            for name in unhonoured_sampling(params, self.honoured[stage.name]):
                prefix = sent_as.get(name, "")
                param = f"{prefix}{body.client_field(name) if stage.name == entry and not prefix else name}"
                raise bad_request(
                    f"{param}: stage '{stage.name}' ({stage.engine} engine) cannot honour {name}; leave it at "
                    f"{SamplingParams.model_fields[name].get_default(call_default_factory=True)!r}",
                    param,
                )
        return resolved

    def _per_stage(self, body: SamplingRequest) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Per-stage overrides by stage name, and the field path each came from (for error messages)."""
        names = self.names
        if body.sampling_params_list is not None:
            if len(body.sampling_params_list) > len(names):
                raise bad_request(
                    f"sampling_params_list: {len(body.sampling_params_list)} entries, but the graph has "
                    f"{len(names)} stages {names} (one entry per stage, in this order)",
                    "sampling_params_list",
                )
            return dict(zip(names, body.sampling_params_list, strict=False)), {
                name: f"sampling_params_list.{i}" for i, name in enumerate(names)
            }
        per_stage = body.stage_sampling or {}
        unknown = sorted(set(per_stage) - set(names))
        if unknown:
            raise bad_request(f"stage_sampling: unknown stage '{unknown[0]}'", "stage_sampling")
        return per_stage, {name: f"stage_sampling.{name}" for name in names}
