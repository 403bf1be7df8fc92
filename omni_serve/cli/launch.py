"""Deploy a graph file onto a running Ray cluster exactly as a user does (`serve run`), and wait for it.

Used by the tests and the benchmarks, which own their Ray cluster and must stop it themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


def load_graph_file(graph: str | Path) -> dict[str, Any]:
    path = Path(graph)
    if not path.is_file():
        path = GRAPHS / graph
    return yaml.safe_load(path.read_text())


def graph_file_config(
    graph: str | Path, port: int, mutate: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """The graph file's Serve config, served on loopback at ``port``, optionally edited by ``mutate``."""
    config = load_graph_file(graph)
    config.setdefault("http_options", {}).update(host="127.0.0.1", port=port)
    if mutate:
        mutate(config)
    return config


def deploy_config(config: dict[str, Any], address: str) -> None:
    """`serve run --non-blocking` a Serve config against the cluster at ``address``."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    cli = [sys.executable, "-m", "ray.serve.scripts", "run", "--non-blocking", "--address", address, f.name]
    try:
        subprocess.run(cli, check=True, env={**os.environ, "RAY_ADDRESS": address}, timeout=180, capture_output=True)
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"serve run failed: {err.stderr.decode(errors='replace')[-2000:]}") from None
    finally:
        os.unlink(f.name)


def deploy_graph_file(
    graph: str | Path,
    address: str,
    port: int,
    mutate: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """`serve run --non-blocking` the graph (optionally edited) against the cluster at ``address``."""
    config = graph_file_config(graph, port, mutate)
    deploy_config(config, address)
    return config


def pad_handoffs(config: dict[str, Any], nbytes: int) -> None:
    """Edit a graph config so every stage pads its handoffs by ``nbytes`` (the stages' ``handoff_padding_bytes``).

    The tiny checkpoint's handoffs are a few KiB; production ones are MiBs (Qwen3-Omni's thinker:
    ~8 KiB a token). Tests and soaks use this to load the object store as production would.
    """
    for app in config["applications"]:
        for stage in app["args"]["stages"]:
            stage["handoff_padding_bytes"] = nbytes


def wait_healthy(base_url: str, timeout_s: float = 300, *, replaced: bool = False) -> None:
    """Wait for ``/health`` to answer 200; fail at once, with Serve's message, if an application failed to deploy.

    ``replaced``: ``deploy_graph_file`` replaced a running graph, so also wait for Serve to report every
    application RUNNING: while the new version's replicas start, the old version's ingress still answers
    ``/health`` 200, and the first requests would wait for the new stages' engines (a 69 s first request
    in a handoff sweep). Needs a Ray connection (the caller's driver) for Serve's status.
    """
    import httpx
    from ray import serve

    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        if not replaced or all(app.status == "RUNNING" for app in serve.status().applications.values()):
            try:
                last = httpx.get(f"{base_url}/health", timeout=15)
                if last.status_code == 200:
                    return
            except httpx.HTTPError as err:
                last = err
        for name, app in serve.status().applications.items():
            if app.status == "DEPLOY_FAILED":
                why = [f"{d}: {s.message}" for d, s in app.deployments.items() if s.status == "DEPLOY_FAILED"]
                raise RuntimeError(f"graph '{name}' failed to deploy: {app.message} {' | '.join(why)[:3000]}")
        time.sleep(1)
    raise TimeoutError(f"graph not healthy after {timeout_s:.0f}s: {last!r}; serve status: {serve.status()}")
