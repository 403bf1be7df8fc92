"""Shared fixtures: one real Ray cluster per test session, graphs deployed with the real `serve run` CLI."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_serve.cli.launch import deploy_graph_file, wait_healthy

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

HTTP_PORT = int(os.environ.get("OMNI_SERVE_TEST_PORT", "18765"))
METRICS_PORT = HTTP_PORT + 1  # Prometheus endpoint of the session cluster's node


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster for the whole session; torn down (Serve, then Ray) at the end."""
    import ray
    from ray import serve

    ray.init(
        address="local",  # never join a cluster someone started with `ray start`
        num_cpus=4,
        include_dashboard=False,
        namespace="serve",
        log_to_driver=False,
        _metrics_export_port=METRICS_PORT,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


class Graphs:
    """Deploys graph files exactly as a user does: `serve run --non-blocking FILE` against the session cluster."""

    def __init__(self, address: str):
        self.address = address
        self.base_url = f"http://127.0.0.1:{HTTP_PORT}"
        self.current: str | None = None

    def deploy(self, graph: str | Path, mutate: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        # Serve rolls a changed app out in the background while the old one keeps answering:
        # delete what runs first, so "healthy" can only mean the graph deployed here.
        self.delete_all()
        config = deploy_graph_file(graph, self.address, HTTP_PORT, mutate)
        self.current = None if mutate else str(graph)
        return config

    def ensure(self, graph: str | Path) -> None:
        """Deploy the unmodified graph unless it is what runs now (saves a redeploy per test module)."""
        if self.current != str(graph):
            self.deploy(graph)
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 300) -> None:
        wait_healthy(self.base_url, timeout_s)

    @staticmethod
    def handle(deployment: str, app: str = "omni"):
        from ray import serve

        return serve.get_deployment_handle(deployment, app_name=app)

    def delete(self, app: str = "omni") -> None:
        from ray import serve

        self.current = None
        serve.delete(app)

    def delete_all(self) -> None:
        from ray import serve

        self.current = None
        for app in list(serve.status().applications):
            serve.delete(app)


@pytest.fixture(scope="session")
def graphs(ray_cluster: str) -> Graphs:
    return Graphs(ray_cluster)


@pytest.fixture(scope="module")
def tiny_omni(graphs: Graphs) -> Graphs:
    """The CPU default graph from graphs/tiny_omni.yaml, healthy; shared by consecutive modules."""
    graphs.ensure("tiny_omni.yaml")
    return graphs
