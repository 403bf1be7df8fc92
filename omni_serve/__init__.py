"""omni_serve: multi-stage omni-modal models as Ray Serve deployment graphs."""

from omni_serve.graph.config import GraphConfig, GraphConfigError, StageConfig, load_graph
from omni_serve.types import Modality, SamplingParams

__all__ = ["GraphConfig", "GraphConfigError", "Modality", "SamplingParams", "StageConfig", "build_app", "load_graph"]


def build_app(args):  # noqa: ANN001, ANN201 - lazy: importing the package must not import Ray Serve
    from omni_serve.app import build_app as _build

    return _build(args)
