"""StagePolicy on a real Serve deployment: a stage whose engine queues requests gets another replica.

The tiny graph runs with the thinker slowed by the transformers engine's test hook
(``min_step_s``), so text requests queue in its engine (one decode at a time per replica),
and with ``max_engine_waiting: {thinker: 0}`` in the policy's kwargs. The thinker's
``target_ongoing_requests`` is far above the load, so Serve's own signal (ongoing requests over
the target) never asks for a second replica: only the engine's ``engine_waiting`` metric
(``record_autoscaling_stats``) can. A bounded load goes to 127.0.0.1 until Serve runs two thinker
replicas; the controller's log line names the reason. The unit tests of the policy are in
tests/test_autoscaling.py.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import HTTP_PORT, graph_variant, wait_until

# Its policy kwargs are part of the code version: a deploy of its own (tiny_variant 2).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600), pytest.mark.tiny_variant(2)]

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
CLIENTS = 4  # concurrent requests: one decodes in the thinker's engine, the others wait there
MAX_REQUESTS = 200  # the load's bound, whatever happens
BODY = {
    "model": "tiny-qwen3-omni",
    "messages": [{"role": "user", "content": "Count to twenty."}],
    "modalities": ["text"],
    "max_tokens": 12,
    "temperature": 0.0,
}
QUEUEING_THINKER = graph_variant(
    engine_args={"thinker": {"min_step_s": 0.1}},
    deployments={
        "thinker": {
            "autoscaling_config": {
                "min_replicas": 1,
                "initial_replicas": 1,
                "max_replicas": 2,
                "target_ongoing_requests": 100,  # ongoing / target stays < 1: only engine_waiting can scale
                "upscale_delay_s": 0,
                "metrics_interval_s": 0.5,
                "look_back_period_s": 2,
            }
        }
    },
    policy_kwargs={"max_engine_waiting": {"thinker": 0}},
)


@pytest.fixture(scope="module")
def graph(graphs: Any) -> Any:
    graphs.deploy("tiny_omni.yaml", QUEUEING_THINKER)
    graphs.wait_healthy()
    return graphs


def replicas(stage: str) -> dict[str, int]:
    from ray import serve

    states = serve.status().applications["omni"].deployments[stage].replica_states
    return {str(getattr(state, "value", state)): count for state, count in states.items()}


def controller_lines(text: str) -> list[str]:
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return [
        line
        for log in logs.glob("controller_*.log")
        for line in log.read_text(errors="replace").splitlines()
        if text in line
    ]


def test_engine_waiting_raises_the_stage_replicas(graph: Any) -> None:
    assert replicas("thinker") == {"RUNNING": 1}
    logged_before = len(controller_lines("omni_serve autoscaling: thinker wants 2"))
    stop = threading.Event()
    sent: list[int] = []

    def client() -> list[int]:
        statuses = []
        with httpx.Client(base_url=BASE_URL, timeout=120) as http:
            while not stop.is_set() and len(sent) < MAX_REQUESTS:
                sent.append(1)
                statuses.append(http.post("/v1/chat/completions", json=BODY).status_code)
        return statuses

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        load = [pool.submit(client) for _ in range(CLIENTS)]
        try:
            # The stage's engine queues (what the policy reads), then Serve starts a second replica.
            wait_until(
                lambda: graph.handle("thinker").stats.remote().result()["waiting"] >= 1, 60, "a queue in the engine"
            )
            wait_until(
                lambda: sum(replicas("thinker").values()) >= 2, 120, lambda: f"a 2nd thinker: {replicas('thinker')}"
            )
            wait_until(
                lambda: replicas("thinker").get("RUNNING") == 2, 180, lambda: f"2 running: {replicas('thinker')}"
            )
        finally:
            stop.set()
            statuses = [status for f in load for status in f.result()]
    assert statuses and set(statuses) == {200}, statuses  # scaling up never failed a request
    # Only the queueing stage scaled: text requests never reach the talker and code2wav.
    assert replicas("talker") == replicas("code2wav") == {"RUNNING": 1}
    # The controller says why: the engine's waiting requests, not the ongoing count.
    lines = wait_until(
        lambda: controller_lines("omni_serve autoscaling: thinker wants 2")[logged_before:],
        30,
        "the policy's log line in the controller log",
    )
    assert "engine_waiting" in lines[0] and "raised by min_ratios" not in lines[0], lines
