"""The graph config: stages, edges, engines and default sampling, validated once at build time.

This is the application ``args`` of a graph file. Replica counts, resources and
autoscaling are not here: they live in the Serve config's ``deployments:`` list,
matched by deployment name = stage name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from omni_serve.types import Modality, SamplingParams

EngineFamily = Literal["transformers", "vllm", "vllm_omni", "diffusers", "vllm_omni_diffusion"]

INGRESS_NAME = "ingress"


class GraphConfigError(ValueError):
    """A graph file is invalid; the message names the offending field."""


class StageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Stage name; also the Serve deployment name.", pattern=r"^[A-Za-z][A-Za-z0-9_-]*$")
    engine: EngineFamily = Field(description="Engine family that runs this stage.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Arguments of the engine family, validated by the engine at start."
    )
    input: str | None = Field(None, description="Upstream stage whose handoffs this stage consumes; None = entry.")
    final_output: Modality | None = Field(None, description="What this stage contributes to the client's reply.")
    default_sampling: SamplingParams = Field(
        default_factory=SamplingParams, description="Sampling defaults; requests override them."
    )

    @field_validator("name")
    @classmethod
    def _not_ingress(cls, name: str) -> str:
        if name == INGRESS_NAME:
            raise ValueError(f"'{INGRESS_NAME}' is reserved for the ingress deployment")
        return name


class GraphConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field(description="Model id reported by /v1/models and accepted in requests.")
    stages: list[StageConfig] = Field(min_length=1, description="The stages; order is only cosmetic.")
    api_key: str | None = Field(
        None, description="If set (or OMNI_SERVE_API_KEY is), requests need 'Authorization: Bearer <key>'."
    )
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Request bodies above this size get 413.")
    stage_timeout_s: float = Field(120.0, gt=0, description="Seconds a request may wait on one stage call.")
    playground: bool = Field(True, description="Serve the browser playground at / (false: / and /playground/ are 404).")

    @model_validator(mode="after")
    def _check_graph(self) -> GraphConfig:
        names = [s.name for s in self.stages]
        for i, stage in enumerate(self.stages):
            if names.count(stage.name) > 1:
                raise ValueError(f"stages[{i}].name: duplicate stage name '{stage.name}'")
            if stage.input is not None and stage.input not in names:
                raise ValueError(f"stages[{i}].input: unknown upstream stage '{stage.input}' (stages: {names})")
        by_name = {s.name: s for s in self.stages}
        for i, stage in enumerate(self.stages):
            seen = [stage.name]
            node = stage
            while node.input is not None:
                if node.input in seen:
                    raise ValueError(f"stages[{i}].input: cycle {' -> '.join(reversed([*seen, node.input]))}")
                seen.append(node.input)
                node = by_name[node.input]
        entries = [s.name for s in self.stages if s.input is None]
        if len(entries) != 1:
            raise ValueError(f"stages: a graph needs exactly one entry stage (with no input), found {entries}")
        if not any(s.final_output for s in self.stages):
            raise ValueError("stages: no stage has a final_output, the graph would return nothing")
        return self

    @property
    def entry(self) -> StageConfig:
        return next(s for s in self.stages if s.input is None)

    def stage(self, name: str) -> StageConfig:
        return next(s for s in self.stages if s.name == name)

    def children(self, name: str) -> list[StageConfig]:
        return [s for s in self.stages if s.input == name]

    @property
    def modalities(self) -> set[Modality]:
        return {s.final_output for s in self.stages if s.final_output}

    def stages_for(self, modalities: set[Modality]) -> set[str]:
        """Stages a request must run: producers of the wanted outputs and their upstreams."""
        needed: set[str] = set()
        for stage in self.stages:
            if stage.final_output in modalities:
                node: StageConfig | None = stage
                while node is not None and node.name not in needed:
                    needed.add(node.name)
                    node = self.stage(node.input) if node.input else None
        return needed


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in e["loc"]).replace(".[", "[")
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc and not msg.startswith(("stages", loc)) else msg)
    return "; ".join(lines)


def load_graph(args: dict[str, Any] | GraphConfig) -> GraphConfig:
    """Validate application args; raise :class:`GraphConfigError` with one readable message."""
    if isinstance(args, GraphConfig):
        return args
    try:
        graph = GraphConfig.model_validate(args)
    except ValidationError as err:
        raise GraphConfigError(f"invalid omni_serve graph: {_format(err)}") from None
    from omni_serve.engines import validate_engine_args

    for i, stage in enumerate(graph.stages):
        problem = validate_engine_args(stage.engine, stage.engine_args)
        if problem:
            raise GraphConfigError(f"invalid omni_serve graph: stages[{i}].engine_args: {problem}")
    return graph
