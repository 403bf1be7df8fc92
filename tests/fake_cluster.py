"""cluster.yaml's node types on one machine: Ray's own autoscaler launching fake nodes (raylets).

Ray ships a "fake multi-node" node provider (``provider: {type: fake_multinode}``,
ray/autoscaler/_private/fake_multi_node/node_provider.py) for exactly this: the cluster launcher's
autoscaler (v1, what ``ray up`` starts on the head) runs unchanged and "launches a node" by starting
one more raylet on this machine with the node type's resources. ``ray.cluster_utils.AutoscalingCluster``
wraps it, but its ``start``/``shutdown`` run ``ray stop --force`` (which would stop every Ray
cluster on a shared machine) and read an ``example.yaml`` the 2.60 wheel does not ship; so
:class:`FakeAutoscalingCluster` starts the head in-process (``ray.cluster_utils.Cluster``, with
the autoscaling config) and stops what it started by process id.

:func:`one_machine_node_types` is the one translation of cluster.yaml's node types; nothing else
lists them. :func:`start_node` starts a node of such a cluster in this process (the head here, test_placement's
worker nodes), again when its raylet died waiting for its agents.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import psutil
import yaml

# Fractional CPUs standing for one GPU: a node type's GPUs become this many CPUs, and a stage's
# ``num_gpus`` the same fraction of them, so Ray packs stages onto the fake nodes as it packs them
# onto GPUs (talker 0.6 + code2wav 0.1 share one gpu_shared node; a second talker needs a new one).
CPUS_PER_GPU = 1.0
# The fake provider's head node type and id (ray/autoscaler/_private/fake_multi_node/node_provider.py).
FAKE_HEAD_TYPE = "ray.head.default"
FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
# Every fake node's object store (the provider passes it to the raylet): handoffs of tiny models are small.
OBJECT_STORE_BYTES = 200 * 1024 * 1024
# Ray 2.60's raylet gives its dashboard agent a fixed 15 s to write its port files and aborts past it (node_manager.cc,
# WaitForDashboardAgentPorts: "Timed out waiting for file .../metrics_agent_port_..."; RAY_agent_register_timeout_ms
# does not reach it: ray-project/ray#65983), and node.py raises "The current node timed out during startup" 30 s on.
# Niced beside the cluster lane (tests/lanes.py), agents took 10-19 s to start in CI on 2026-12-02: one of the 13
# nodes started missed it, and test_placement failed on it. A start that fails so is made again, this many times.
NODE_START_ATTEMPTS = 3
NODE_START_FAILED = "The current node timed out during startup"

T = TypeVar("T")


def start_node(start: Callable[[], T]) -> T:
    """``start()``, which starts a Ray node in this process (``Cluster(initialize_head=True)``, ``add_node``); made
    again when the node's raylet died starting (:data:`NODE_START_ATTEMPTS`), once what the failed start left running
    (the processes it started and theirs; the head's GCS keeps its port) is stopped by process id."""
    me = psutil.Process()
    for attempt in range(1, NODE_START_ATTEMPTS + 1):
        before = {child.pid for child in me.children()}
        try:
            return start()
        except Exception as e:
            if NODE_START_FAILED not in str(e) or attempt == NODE_START_ATTEMPTS:
                raise
            left = [child for child in me.children() if child.pid not in before]
            left += [grandchild for child in left for grandchild in child.children(recursive=True)]
            for process in left:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(left, timeout=30)
            print(f"fake_cluster: a Ray node did not start (attempt {attempt}: {e}); starting it again", flush=True)
    raise AssertionError("unreachable")


def gpus_as_cpus(resources: dict[str, float]) -> dict[str, float]:
    """A node's or a replica's resources with its GPUs turned into CPUs (``CPUS_PER_GPU`` each).

    A GPU node's own CPUs are dropped: on one machine they would let Ray pack more replicas on a
    node than its GPUs hold. CPU-only resources (the head) stay as they are; custom resources
    (the node-type markers) are kept.
    """
    out = {k: v for k, v in resources.items() if k not in ("GPU", "CPU", "num_gpus", "num_cpus")}
    gpus = resources.get("GPU", resources.get("num_gpus", 0))
    cpus = resources.get("CPU", resources.get("num_cpus", 0))
    key = "num_cpus" if "num_cpus" in resources or "num_gpus" in resources else "CPU"
    out[key] = gpus * CPUS_PER_GPU if gpus else cpus
    return out


def one_machine_node_types(cluster_config: dict[str, Any]) -> dict[str, Any]:
    """cluster.yaml's ``available_node_types`` for the fake provider: the one translation.

    Per node type: ``resources`` through :func:`gpus_as_cpus` (markers kept) plus a small object
    store, ``max_workers`` as written, ``min_workers`` 0 (the cluster starts with no GPU worker, so
    every worker node is one the autoscaler launched for pending replicas), ``node_config`` empty
    (the provider has nothing to configure). The head type is renamed to the provider's
    ``ray.head.default`` with no workers.
    """
    types = {}
    for name, node_type in cluster_config["available_node_types"].items():
        head = name == cluster_config["head_node_type"]
        types[FAKE_HEAD_TYPE if head else name] = {
            "resources": {**gpus_as_cpus(node_type.get("resources", {})), "object_store_memory": OBJECT_STORE_BYTES},
            "node_config": {},
            "min_workers": 0,
            "max_workers": 0 if head else node_type["max_workers"],
        }
    return types


def autoscaling_config(cluster_config: dict[str, Any], gcs_address: str, idle_timeout_minutes: float) -> dict[str, Any]:
    """The launcher config the head's autoscaler reads: cluster.yaml with the fake provider and node types."""
    return {
        "cluster_name": "omni-serve-one-machine",
        "max_workers": cluster_config["max_workers"],
        "upscaling_speed": cluster_config.get("upscaling_speed", 1.0),
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,  # the provider's default is port 6379; ours is explicit
            "use_node_id_as_ip": True,  # every fake node has this machine's IP
            "disable_node_updaters": True,  # nothing to ssh into; a node whose raylet died is terminated
            "disable_launch_config_check": True,
        },
        "available_node_types": one_machine_node_types(cluster_config),
        "head_node_type": FAKE_HEAD_TYPE,
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class FakeAutoscalingCluster:
    """A head node (this machine's IP, ``gcs_port``) whose autoscaler launches cluster.yaml's node types.

    The autoscaler runs in the head's monitor process with ``RAY_FAKE_CLUSTER=1`` and the
    ``AUTOSCALER_*`` settings given (inherited from this process's environment, set here).
    """

    def __init__(
        self,
        cluster_yaml: Path,
        gcs_port: int,
        dashboard_port: int,
        idle_timeout_minutes: float,
        autoscaler_env: dict[str, str],
        system_config: dict[str, Any] | None = None,
    ) -> None:
        import ray
        from ray.cluster_utils import Cluster

        config = yaml.safe_load(cluster_yaml.read_text())
        ip = ray._private.services.get_node_ip_address()
        self.gcs_address = f"{ip}:{gcs_port}"
        self.config = autoscaling_config(config, self.gcs_address, idle_timeout_minutes)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(self.config, f)
        self._config_file = f.name
        os.environ.update({"RAY_FAKE_CLUSTER": "1", **autoscaler_env})
        head = dict(self.config["available_node_types"][FAKE_HEAD_TYPE]["resources"])
        self.cluster = start_node(
            lambda: Cluster(
                initialize_head=True,
                head_node_args={
                    "gcs_server_port": gcs_port,
                    "num_cpus": head.pop("CPU"),
                    "object_store_memory": head.pop("object_store_memory"),
                    "resources": head,
                    "autoscaling_config": self._config_file,
                    "include_dashboard": True,  # ray.util.state (list_actors) goes through it
                    "dashboard_port": dashboard_port,
                    "env_vars": {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID},
                    "_system_config": system_config or {},
                },
            )
        )
        self.address = self.cluster.address

    def raylets(self) -> dict[str, psutil.Process]:
        """Node id -> raylet process of every fake worker node of this cluster (found by our GCS address)."""
        found = {}
        for proc in self._processes():
            if proc.info["name"] == "raylet":
                env = proc.environ()
                if "RAY_OVERRIDE_NODE_ID_FOR_TESTING" in env:
                    found[env["RAY_OVERRIDE_NODE_ID_FOR_TESTING"]] = proc
        return found

    def _processes(self) -> list[psutil.Process]:
        """Every process of this cluster the head did not start: fake nodes' raylets, agents, workers."""
        mine = []
        for proc in psutil.process_iter(["name", "cmdline"]):
            try:
                if any(self.gcs_address in arg for arg in proc.info["cmdline"] or []):
                    mine.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return mine

    def shutdown(self) -> None:
        """Stop the head's processes, then the fake nodes' (by pid: the autoscaler that launched them is gone)."""
        try:
            self.cluster.shutdown()
        finally:
            for proc in self._processes():
                try:
                    proc.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
            os.unlink(self._config_file)
