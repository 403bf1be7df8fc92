"""The streamed handoffs' channel actors alive in the cluster."""

from __future__ import annotations

from typing import Any

from omni_serve.graph.transport import CHANNELS_ACTOR_PREFIX


def channel_actors() -> list[Any]:
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return [
        ray.get_actor(a["name"], namespace=a["namespace"]) for a in named if a["name"].startswith(CHANNELS_ACTOR_PREFIX)
    ]
