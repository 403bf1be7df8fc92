"""Multi-node placement on one machine: stages pinned to node types land and fail over correctly.

A real multi-raylet Ray cluster (``ray.cluster_utils.Cluster``; CPU only, fractional CPUs)
whose worker nodes advertise the node-type marker resources of cluster.yaml /
deploy/kuberay.yaml (``omni_gpu_big``, ``omni_gpu_shared``). The tiny graph is deployed
with the real ``serve run`` CLI, its stages pinned like graphs/qwen3_omni.yaml pins the GPU
stages: thinker on a big node, talker + code2wav on a shared node. Then the nodes hosting
them are removed and the replicas must come back on the surviving node of the same type.

That test owns its cluster, so it cannot share the session ``ray_cluster`` fixture: it is
marked ``multinode`` and runs in a pytest process of its own (tests/lanes.py's multinode lane, or
``pytest -m multinode``; the rest with ``-m "not multinode"``). The fast checks at the end keep the graph's
pins, cluster.yaml and deploy/kuberay.yaml in agreement.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest
import yaml

from omni_serve.cli.launch import GRAPHS, deploy_graph_file, wait_healthy
from omni_serve.models.qwen3_omni import SAMPLE_RATE
from tests.audio import whole_reply_audio
from tests.conftest import RECOVERY_TIMEOUT_S, graph_variant, patient, serve_driver, wait_until
from tests.fake_cluster import start_node

HTTP_PORT = int(os.environ.get("OMNI_SERVE_TEST_PORT", "18765"))
BIG, SHARED, HEAD = "omni_gpu_big", "omni_gpu_shared", "omni_head"
PINS = {"thinker": BIG, "talker": SHARED, "code2wav": SHARED}
PER_REPLICA = 0.01  # as graphs/qwen3_omni.yaml asks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeTypes:
    """The test cluster: a CPU head and two worker nodes of each pinned type."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        head = {
            "num_cpus": 1,
            "resources": {HEAD: 1},
            "include_dashboard": True,  # ray.util.state (list_actors) goes through it
            "dashboard_port": _free_port(),
        }
        self.cluster = start_node(lambda: Cluster(initialize_head=True, head_node_args=head))
        self.kind: dict[str, str] = {self.cluster.head_node.node_id: HEAD}
        self.nodes: dict[str, Any] = {}
        for kind in (BIG, BIG, SHARED, SHARED):
            node = start_node(partial(self.cluster.add_node, num_cpus=1, resources={kind: 1}))
            self.kind[node.node_id] = kind
            self.nodes[node.node_id] = node
        self.cluster.wait_for_nodes()

    def replicas(self) -> dict[str, list[str]]:
        """Stage -> node ids of its ALIVE replicas."""
        from ray.util.state import list_actors

        found: dict[str, list[str]] = {stage: [] for stage in PINS}
        # This cluster's address, never auto-discovery: another Ray instance on the machine would win.
        actors = list_actors(address=self.cluster.address, filters=[("state", "=", "ALIVE")], limit=1000)
        for actor in actors:
            name = actor.class_name or ""
            if name.startswith("ServeReplica:omni:"):
                stage = name.rsplit(":", 1)[1]
                if stage in found:
                    found[stage].append(actor.node_id)
        return found

    def wait_placed(self, timeout_s: float, avoid: set[str] = frozenset()) -> dict[str, str]:
        """Wait until every stage has exactly one ALIVE replica, not on ``avoid``; stage -> node id."""

        def placed() -> dict[str, str] | dict[str, list[str]] | None:
            found = self.replicas()
            if all(len(nodes) == 1 and nodes[0] not in avoid for nodes in found.values()):
                return {stage: nodes[0] for stage, nodes in found.items()}
            return None

        return wait_until(placed, timeout_s, "one ALIVE replica per stage on the allowed nodes", interval_s=1)


# tiny_omni.yaml with its stages pinned to node types (as graphs/qwen3_omni.yaml), ingress on the head.
# One replica a stage, no autoscaling: the requests queued while the nodes are lost once grew the talker
# to 2 (its target is 2 ongoing), and "one replica per stage off the lost nodes" then never held (a CI
# flake, 1 run in 4). Scaling across node types is tests/test_autoscaling_cluster.py's.
PINNED = patient(
    graph_variant(
        fixed_replicas=1,
        deployments={
            name: {"ray_actor_options": {"num_cpus": 0.2, "resources": {PINS.get(name, HEAD): PER_REPLICA}}}
            for name in ("ingress", *PINS)
        },
    )
)


@pytest.fixture(scope="module")
def node_types() -> Iterator[NodeTypes]:
    import ray

    if ray.is_initialized():
        pytest.skip(
            "Ray is already initialized in this process; the multinode test starts its own "
            "multi-raylet cluster: run it alone with `pytest -m multinode`"
        )
    nodes = NodeTypes()
    try:
        with serve_driver(nodes.cluster.address):
            deploy_graph_file("tiny_omni.yaml", nodes.cluster.address, HTTP_PORT, PINNED)
            yield nodes
    finally:
        nodes.cluster.shutdown()


@pytest.mark.multinode
@pytest.mark.integration
@pytest.mark.timeout(1800)  # a hang guard: niced beside the cluster lane (tests/lanes.py)
def test_stages_land_on_their_node_type_and_fail_over_within_it(node_types: NodeTypes):
    base_url = f"http://127.0.0.1:{HTTP_PORT}"
    wait_healthy(base_url, timeout_s=600)
    placed = node_types.wait_placed(timeout_s=300)
    for stage, node_id in placed.items():
        assert node_types.kind[node_id] == PINS[stage], (stage, node_types.kind[node_id])

    # Under load, lose the big node with the thinker and the shared node with the talker (and maybe
    # code2wav): every request in flight completes or fails cleanly with a JSON 5xx, none hangs.
    def ask(i: int) -> httpx.Response:
        body = {
            "model": "tiny-qwen3-omni",
            "messages": [{"role": "user", "content": f"Hi {i}"}],
            "modalities": ["text", "audio"],
            "max_tokens": 8,
            "stage_sampling": {"talker": {"max_tokens": 48}},
            "return_stage_metrics": True,  # the talker's frame count: the WAV is checked whole
        }
        return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=RECOVERY_TIMEOUT_S + 120)

    lost = {placed["thinker"], placed["talker"]}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        in_flight = [pool.submit(ask, i) for i in range(6)]
        # Lose the nodes once the load is inside the graph: the talker is working on a request.
        from ray import serve

        talker = serve.get_deployment_handle("talker", app_name="omni")
        wait_until(lambda: talker.stats.remote().result()["requests_total"] >= 1, 120, "the load to reach the talker")
        for node_id in lost:
            node_types.cluster.remove_node(node_types.nodes[node_id], allow_graceful=False)
        outcomes = [f.result() for f in in_flight]  # httpx raises if one hangs past its timeout
    for response in outcomes:
        if response.status_code == 200:
            whole_reply_audio(response.json(), SAMPLE_RATE)
        else:
            # A lost replica or a handoff lost with its node is "unavailable, retry", never a server bug.
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "service_unavailable" and response.headers["retry-after"], response.text

    moved = node_types.wait_placed(timeout_s=RECOVERY_TIMEOUT_S, avoid=lost)
    for stage, node_id in moved.items():
        assert node_types.kind[node_id] == PINS[stage], (stage, node_types.kind[node_id])
    assert moved["thinker"] != placed["thinker"] and moved["talker"] != placed["talker"]
    wait_healthy(base_url, timeout_s=300)

    reply = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": "tiny-qwen3-omni",
            "messages": [{"role": "user", "content": "Hi"}],
            "modalities": ["text", "audio"],
            "max_tokens": 4,
            "stage_sampling": {"talker": {"max_tokens": 8}},
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["audio"]["data"]


# ---- the shipped placement files agree (fast, no cluster) ---------------------------------------------

ROOT = GRAPHS.parent


def _qwen3_pins() -> dict[str, dict[str, float]]:
    app = yaml.safe_load((GRAPHS / "qwen3_omni.yaml").read_text())["applications"][0]
    return {d["name"]: d["ray_actor_options"].get("resources", {}) for d in app["deployments"]}


def test_qwen3_graph_pins_its_stages_like_this_test_does():
    assert _qwen3_pins() == {
        "ingress": {},
        **{stage: {kind: PER_REPLICA} for stage, kind in PINS.items()},
    }


def test_cluster_launcher_node_types_advertise_the_pins_and_fit_the_stages():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))  # what `ray up` checks: Ray's cluster-launcher schema
    types = config["available_node_types"]
    deployments = {
        d["name"]: d for d in yaml.safe_load((GRAPHS / "qwen3_omni.yaml").read_text())["applications"][0]["deployments"]
    }
    for stage, kind in PINS.items():
        offering = [name for name, t in types.items() if kind in t.get("resources", {})]
        assert len(offering) == 1, (kind, offering)
        node = types[offering[0]]["resources"]
        options = deployments[stage]["ray_actor_options"]
        assert node["GPU"] >= options["num_gpus"] and node["CPU"] >= options["num_cpus"], stage
    on_shared = [deployments[s]["ray_actor_options"]["num_gpus"] for s, k in PINS.items() if k == SHARED]
    assert sum(on_shared) <= 1  # talker + code2wav share one GPU of a gpu_shared node
    assert not set(types[config["head_node_type"]].get("resources", {})) & {BIG, SHARED}
    # Every node's Ray starts with Serve's HAProxy ingress and the API key (read when Ray's processes start: an
    # ingress replica, wherever it lands, has the key; without it, on 0.0.0.0, it would not start).
    environment = 'RAY_SERVE_ENABLE_HA_PROXY=1 OMNI_SERVE_API_KEY="$(cat ~/.omni_serve_api_key)" ray start'
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        starts = [c for c in commands if "ray start" in c]
        assert starts and all(c.startswith(environment) for c in starts), commands
    assert "~/.omni_serve_api_key" in config["file_mounts"]


# The API key every pod's Ray hands its processes: Serve listens on 0.0.0.0, where an ingress without one
# does not start.
API_KEY_ENV = {
    "name": "OMNI_SERVE_API_KEY",
    "valueFrom": {"secretKeyRef": {"name": "omni-serve-api-key", "key": "key"}},
}


def test_kuberay_service_serves_the_qwen3_graph_on_the_same_node_types():
    """deploy/kuberay.yaml read as KubeRay's in-tree autoscaler reads it, pod templates by Kubernetes' schemas.

    No PyPI package ships the RayService CRD's OpenAPI schema (KubeRay publishes it in its Helm chart
    only). What the autoscaler sidecar makes of ``rayClusterConfig`` is Ray's own code
    (``ray.autoscaler._private.kuberay.autoscaling_config``, which ends in the same
    ``validate_config`` as ``ray up``); the pod templates KubeRay hands to Kubernetes are checked,
    unknown fields rejected, against the Kubernetes JSON schemas kubernetes-validate ships (PyPI).
    """
    import kubernetes_validate
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    service = yaml.safe_load((ROOT / "deploy" / "kuberay.yaml").read_text())
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    graph = yaml.safe_load((GRAPHS / "qwen3_omni.yaml").read_text())
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == graph  # one source: the graph file

    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:  # Serve's HAProxy ingress on every pod
            assert {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"} in container.get("env", []), group
            assert API_KEY_ENV in container["env"], group  # and the key: the ingress may land on any pod
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": group["template"]}
        kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)

    ray_cr = {"metadata": {"name": service["metadata"]["name"], "namespace": "default"}, "spec": cluster}
    kuberay = _derive_autoscaling_config_from_ray_cr(ray_cr)["available_node_types"]
    launcher = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    launcher_types = launcher["available_node_types"]

    def shape(node_type: dict) -> tuple:
        resources = node_type["resources"]
        markers = sorted((k, v) for k, v in resources.items() if k in (BIG, SHARED))
        return markers, resources.get("GPU", 0), node_type["min_workers"], node_type["max_workers"]

    head = launcher["head_node_type"]
    assert sorted(shape(t) for name, t in kuberay.items() if name != "headgroup") == sorted(
        shape(t) for name, t in launcher_types.items() if name != head
    )
    assert shape(kuberay["headgroup"])[:2] == ([], 0)  # no stage lands on the head
