"""cluster.yaml's node types under Ray's own autoscaler, on one machine: nodes come and go per stage.

The head's autoscaler (the cluster launcher's v1, as ``ray up`` starts it) runs with Ray's fake
multi-node provider: launching a node starts a raylet here with the node type's resources
(:mod:`tests.fake_cluster`; GPUs become fractional CPUs, the cluster starts with no GPU worker).
The tiny omni graph is deployed with each stage's ``ray_actor_options`` taken from
graphs/qwen3_omni.yaml through the same translation, so its stages are pinned to node types exactly
as the GPU graph's are. The test then watches what the issue asks:

1. the autoscaler launches a node of each pinned type and the graph serves from those new nodes;
2. under load the talker's autoscaling adds a replica that does not fit (talker 0.6 + code2wav 0.1
   of one gpu_shared "GPU"), a second gpu_shared node is launched, and gpu_big does not grow;
3. after the load the replica goes (Serve ``downscale_delay_s`` 4 s) and then its node
   (``idle_timeout_minutes`` 0.1 = 6 s; cluster.yaml says 10 min);
4. a gpu_shared node lost under load (its raylet SIGKILLed): talker and code2wav come back on a
   newly launched gpu_shared node, ``/health`` says the stages are loading, then ready.

Every request sent meanwhile must complete with a whole WAV or get a 503 with ``Retry-After``.
Owns its cluster: marked ``multinode``, run in a pytest process of its own (tests/lanes.py's multinode lane,
or ``pytest -m multinode``).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from omni_serve.cli.launch import GRAPHS, deploy_graph_file, wait_healthy
from omni_serve.models.qwen3_omni import SAMPLE_RATE
from tests.audio import whole_reply_audio
from tests.conftest import RECOVERY_TIMEOUT_S, graph_variant, patient, serve_driver, wait_until
from tests.fake_cluster import FakeAutoscalingCluster, gpus_as_cpus

# 1800 s: a hang guard; niced beside the cluster lane (tests/lanes.py) it takes twice its ~200 s alone.
pytestmark = [pytest.mark.multinode, pytest.mark.integration, pytest.mark.timeout(1800)]

HTTP_PORT = int(os.environ.get("OMNI_SERVE_TEST_PORT", "18765"))
GCS_PORT, DASHBOARD_PORT = HTTP_PORT + 11, HTTP_PORT + 12
BIG, SHARED = "gpu_big", "gpu_shared"  # cluster.yaml's worker node types
MARKERS = {"omni_gpu_big": BIG, "omni_gpu_shared": SHARED}
STAGE_TYPE = {"thinker": BIG, "talker": SHARED, "code2wav": SHARED}
IDLE_TIMEOUT_MINUTES = 0.1  # a node idle 6 s is removed (cluster.yaml: 10 min)
DOWNSCALE_DELAY_S = 4  # Serve removes a replica not needed for 4 s (qwen3_omni.yaml: 600 s)


def _qwen3_actor_options() -> dict[str, dict[str, Any]]:
    """Each deployment's ray_actor_options in graphs/qwen3_omni.yaml, GPUs as CPUs (as the node types)."""
    app = yaml.safe_load((GRAPHS / "qwen3_omni.yaml").read_text())["applications"][0]
    return {d["name"]: {"ray_actor_options": gpus_as_cpus(d["ray_actor_options"])} for d in app["deployments"]}


def _autoscaling(max_replicas: int, target: float) -> dict[str, Any]:
    return {
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": max_replicas,
            "target_ongoing_requests": target,
            "upscale_delay_s": 1,
            "downscale_delay_s": DOWNSCALE_DELAY_S,
            "metrics_interval_s": 0.5,  # as tests/test_autoscaling_live.py
            "look_back_period_s": 2,
        }
    }


# Only the talker may grow (to 2; one talker call in flight is its target): the thinker fits a
# second replica on its gpu_big node anyway, but two CPU cores run this test, not eight GPUs.
PINNED = patient(
    graph_variant(
        deployments={
            name: {
                **options,
                **(_autoscaling(2, 1) if name == "talker" else _autoscaling(1, 4) if name != "ingress" else {}),
            }
            for name, options in _qwen3_actor_options().items()
        }
    )
)


class Cluster(FakeAutoscalingCluster):
    def node_types(self) -> dict[str, str]:
        """Alive worker node id -> its cluster.yaml node type (by the marker resource it advertises)."""
        import ray

        kinds = {}
        for node in ray.nodes():
            if node["Alive"]:
                for marker, kind in MARKERS.items():
                    if marker in node["Resources"]:
                        kinds[node["NodeID"]] = kind
        return kinds

    def count(self, kind: str) -> int:
        return sum(k == kind for k in self.node_types().values())

    def replicas(self) -> dict[str, list[str]]:
        """Stage -> node ids of its ALIVE replicas."""
        from ray.util.state import list_actors

        found: dict[str, list[str]] = {stage: [] for stage in STAGE_TYPE}
        actors = list_actors(address=self.address, filters=[("state", "=", "ALIVE")], limit=1000)
        for actor in actors:
            stage = (actor.class_name or "").rsplit(":", 1)[-1]
            if (actor.class_name or "").startswith("ServeReplica:omni:") and stage in found:
                found[stage].append(actor.node_id)
        return found

    def replicas_if(self, condition: Any) -> dict[str, list[str]] | None:
        found = self.replicas()
        return found if condition(found) else None


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    import ray

    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process: run it alone with `pytest -m multinode`")
    saved = dict(os.environ)
    nodes = Cluster(
        GRAPHS.parent / "cluster.yaml",
        GCS_PORT,
        DASHBOARD_PORT,
        IDLE_TIMEOUT_MINUTES,
        # The autoscaler's loop every 1 s (default 5); a node silent 10 s is unhealthy and terminated (default 30).
        autoscaler_env={"AUTOSCALER_UPDATE_INTERVAL_S": "1", "AUTOSCALER_HEARTBEAT_TIMEOUT_S": "10"},
        # The GCS declares a killed raylet dead after 3 missed 1 s health checks (default 5 x 3 s).
        system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
    )
    try:
        with serve_driver(nodes.address):
            assert nodes.node_types() == {}, "the cluster starts with no worker node"
            deploy_graph_file("tiny_omni.yaml", nodes.address, HTTP_PORT, PINNED)
            yield nodes
    finally:
        nodes.shutdown()
        os.environ.clear()
        os.environ.update(saved)


BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"


def ask(i: int) -> httpx.Response:
    body = {
        "model": "tiny-qwen3-omni",
        "messages": [{"role": "user", "content": f"Hi {i}"}],
        "modalities": ["text", "audio"],
        "max_tokens": 6,
        "stage_sampling": {"talker": {"max_tokens": 64}},
        "return_stage_metrics": True,  # the talker's frame count: check() checks the WAV is whole
    }
    return httpx.post(f"{BASE_URL}/v1/chat/completions", json=body, timeout=RECOVERY_TIMEOUT_S + 120)  # a hang raises


def check(outcomes: list[httpx.Response]) -> int:
    """Every answer a whole WAV or a clean 503 with Retry-After; returns how many succeeded."""
    ok = 0
    for response in outcomes:
        if response.status_code == 200:
            whole_reply_audio(response.json(), SAMPLE_RATE)
            ok += 1
        else:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "service_unavailable" and response.headers["retry-after"]
    return ok


class Load:
    """``clients`` loops of requests until stopped (or ``max_s``); bounded in time and count."""

    def __init__(self, clients: int, max_s: float = 240) -> None:
        self.stop = threading.Event()
        self.outcomes: list[httpx.Response] = []
        self._deadline = time.monotonic() + max_s
        self._pool = concurrent.futures.ThreadPoolExecutor(clients)
        self._loops = [self._pool.submit(self._loop, c) for c in range(clients)]

    def _loop(self, client: int) -> None:
        i = 0
        while not self.stop.is_set() and time.monotonic() < self._deadline:
            self.outcomes.append(ask(client * 1000 + i))
            i += 1

    def finish(self) -> list[httpx.Response]:
        self.stop.set()
        for loop in self._loops:
            loop.result()
        self._pool.shutdown()
        return self.outcomes


def test_stage_nodes_are_launched_scaled_and_removed_per_node_type(cluster: Cluster):
    wait_healthy(BASE_URL, timeout_s=600)
    kinds = cluster.node_types()
    placed = wait_until(lambda: cluster.replicas_if(lambda r: all(len(n) == 1 for n in r.values())), 300, "placement")
    for stage, (node,) in placed.items():
        assert kinds.get(node) == STAGE_TYPE[stage], (stage, kinds)  # a launched worker node, of its type
    assert sorted(kinds.values()) == [BIG, SHARED]
    assert check([ask(0)]) == 1

    # Load: the talker wants 2 replicas; the second does not fit on the gpu_shared node.
    load = Load(clients=4)
    try:
        found = wait_until(lambda: cluster.replicas_if(lambda r: len(r["talker"]) == 2), 400, "a second talker")
        grown = found["talker"]
        kinds = cluster.node_types()
        assert [kinds.get(node) for node in grown] == [SHARED, SHARED] and grown[0] != grown[1], kinds
        assert sorted(kinds.values()) == [BIG, SHARED, SHARED]  # only the talker's node type grew
        time.sleep(3)  # requests served by both talker replicas
    finally:
        scale_up = load.finish()
    assert check(scale_up) >= 1, [r.status_code for r in scale_up]

    # Idle: the talker replica goes (4 s), then its node (6 s idle); requests meanwhile stay whole.
    requests_while_down = [ask(i) for i in range(2)]
    wait_until(lambda: len(cluster.replicas()["talker"]) == 1, 300, "the talker back to 1 replica")
    wait_until(lambda: cluster.count(SHARED) == 1, 300, lambda: f"idle gpu_shared node gone: {cluster.node_types()}")
    assert cluster.count(BIG) == 1
    assert check(requests_while_down + [ask(2)]) >= 1

    # Lose the gpu_shared node (talker + code2wav) under load: its raylet SIGKILLed by pid.
    lost = cluster.replicas()["talker"][0]
    raylet = cluster.raylets()[lost]
    load = Load(clients=3, max_s=180)
    seen: list[tuple[int, dict[str, Any]]] = []

    def health() -> tuple[int, dict[str, Any]]:
        response = httpx.get(f"{BASE_URL}/health", timeout=15)
        seen.append((response.status_code, response.json()))
        return seen[-1]

    try:
        from ray import serve

        talker = serve.get_deployment_handle("talker", app_name="omni")
        served = talker.stats.remote().result()["requests_total"]
        wait_until(lambda: talker.stats.remote().result()["requests_total"] > served, 300, "load on the talker")
        before_loss = set(cluster.node_types())
        raylet.kill()
        loading = wait_until(lambda: (h := health())[1]["stages"]["talker"] == "loading" and h, 300, "talker loading")
        assert loading[0] == 503 and loading[1]["status"] == "unavailable", loading
        wait_until(lambda: health()[0] == 200, RECOVERY_TIMEOUT_S, lambda: f"/health ready again; last {seen[-1:]}")
    finally:
        after_loss = load.finish()
    moved = cluster.replicas()
    kinds = cluster.node_types()
    assert lost not in kinds
    for stage in ("talker", "code2wav"):  # (the load may have grown the talker to 2 again)
        assert moved[stage] and {kinds.get(node) for node in moved[stage]} == {SHARED}, (stage, moved, kinds)
    assert set(moved["talker"] + moved["code2wav"]) - before_loss, "no replica on a newly launched gpu_shared node"
    check(after_loss)
    assert check([ask(3)]) == 1
