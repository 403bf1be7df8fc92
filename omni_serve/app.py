"""``build_app(args)``: the import_path of every graph file.

Validates the graph once (a bad graph fails ``serve run`` with one message naming
the field), then binds one stage deployment per stage, named after the stage so
the graph file's ``deployments:`` entries apply to it, and the ingress on top (a graph with
``engine_in_ingress`` has no stage deployment: the ingress runs its one stage).
"""

from __future__ import annotations

from typing import Any, cast

from ray.serve import Application, Deployment

from omni_serve.api.ingress import Ingress
from omni_serve.graph.config import INGRESS_NAME, GraphConfig, load_graph
from omni_serve.graph.stage import StageDeployment

# @serve.deployment made both classes Serve Deployments; mypy keeps a class decorator's input type.
INGRESS = cast(Deployment, Ingress)
STAGE = cast(Deployment, StageDeployment)


def build_app(args: dict[str, Any] | GraphConfig) -> Application:
    graph = load_graph(args)
    # The entry stage fetches and decodes the requests' media: it gets the media policy and limits.
    media = {"policy": graph.media_policy.model_dump(mode="json"), "input": graph.media_input.model_dump(mode="json")}
    if graph.engine_in_ingress:
        return INGRESS.options(name=INGRESS_NAME).bind(graph.model_dump(mode="json"), {}, media)
    stages = {
        stage.name: STAGE.options(name=stage.name).bind(
            stage.model_dump(mode="json"), media if stage.name == graph.entry.name else None
        )
        for stage in graph.stages
    }
    return INGRESS.options(name=INGRESS_NAME).bind(graph.model_dump(mode="json"), stages)
