"""The one line a person waits for: where the API and the playground are, and which stages run.

``make serve`` (:mod:`omni_serve.cli.run`) prints it once ``/health`` answers 200; the ingress logs
the same line when Serve reports its whole application running, so that a plain
``serve run graphs/X.yaml`` shows it too.
"""

from __future__ import annotations

import asyncio
import logging

from omni_serve.graph.config import GraphConfig
from omni_serve.graph.readiness import ServeView

logger = logging.getLogger("ray.serve")

POLL_S = 1.0


def base_url(host: str, port: int, route_prefix: str | None) -> str:
    """The URL a browser on this machine reaches the application at (a wildcard bind means localhost)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}{(route_prefix or '/').rstrip('/')}"


def stage_paths(graph: GraphConfig) -> str:
    """The graph as its paths from the entry stage, e.g. ``thinker -> talker -> code2wav``."""
    paths: list[str] = []

    def walk(name: str, path: list[str]) -> None:
        children = graph.children(name)
        if not children:
            paths.append(" -> ".join([*path, name]))
        for child in children:
            walk(child.name, [*path, name])

    walk(graph.entry.name, [])
    return "; ".join(paths)


def ready_line(url: str, graph: GraphConfig, after_s: float | None = None) -> str:
    when = f" in {after_s:.0f} s" if after_s is not None else ""
    parts = [f"omni_serve ready{when}: API {url}/v1"]
    if graph.playground:
        parts.append(f"playground {url}/")
    parts.append(f"{graph.served_model_name}: {stage_paths(graph)}")
    return " | ".join(parts)


async def announce_when_running(graph: GraphConfig, view: ServeView) -> None:
    """Log the ready line once Serve reports every deployment of the ingress' application running."""
    try:
        # Polls on purpose: reading the view is what keeps its background refresh going.
        while (app := await view.application()).get("status") != "RUNNING":  # noqa: ASYNC110
            await asyncio.sleep(POLL_S)
        http = (await view.details()).get("http_options", {})
        url = base_url(http.get("host", "127.0.0.1"), http.get("port", 8000), app.get("route_prefix"))
        logger.info(ready_line(url, graph))
    except Exception as err:  # a cosmetic line must never take the ingress down
        logger.warning("omni_serve: could not tell when the graph is ready: %r", err)
