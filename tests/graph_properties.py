"""The graph properties every served family must hold, as checks a family's integration module runs on its graph.

Each check takes the deployed graph (``tests.conftest.Graphs``, one replica a stage) and the family
(:mod:`tests.families`), and asserts on what the cluster and the engines report, never on timing:

- one Serve deployment per stage, each with its own replicas and autoscaling config, under the graph's policy;
- handoffs by reference (the ingress never loads one while every downstream stage does) and freed on use
  (every object the request made is gone once it ended); a one-stage graph hands nothing off, and of this only
  holds that the ingress loads nothing and whatever the request made is freed;
- a client that leaves cancels every stage: every engine drops the request (nothing running, waiting or
  streaming) and the engines it was running in count it aborted;
- readiness per stage: ``/health`` names every stage, each ready.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from omni_serve.cli.launch import load_graph_file
from tests.conftest import wait_until
from tests.families import Family
from tests.object_store import objects_of_at_least

FREED_WITHIN_S = 10
SEEN_MIN_BYTES = 256  # a census of the objects a request makes (handoffs, stream items), without control noise
CENSUS_TRIES = 3


def stage_names(family: Family) -> list[str]:
    return [s["name"] for s in load_graph_file(family.graph)["applications"][0]["args"]["stages"]]


def stage_stats(graph: Any, family: Family) -> dict[str, dict[str, Any]]:
    return {name: graph.handle(name).stats.remote().result() for name in stage_names(family)}


def one_deployment_per_stage(graph: Any, family: Family) -> None:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ray.get(controller.get_serve_instance_details.remote())["applications"]["omni"]
    stages = stage_names(family)
    assert set(details["deployments"]) == {"ingress", *stages}, family.name
    replicas: set[str] = set()
    for name in stages:
        deployment = details["deployments"][name]
        config = deployment["deployment_config"]
        assert config.get("autoscaling_config") or config.get("num_replicas"), (family.name, name)
        ids = {r["replica_id"] for r in deployment["replicas"] if r["state"] == "RUNNING"}
        assert ids and not ids & replicas, (family.name, name)  # replicas of its own
        replicas |= ids
    policy = details["deployed_app_config"].get("autoscaling_policy") or {}
    assert policy.get("policy_function") == "omni_serve.graph.autoscaling:StagePolicy", family.name


def handoffs_by_reference_and_freed(graph: Any, family: Family) -> None:
    stages = stage_names(family)
    ingress_before = graph.handle("ingress").payload_loads.remote().result()
    before = stage_stats(graph, family)
    seen: set[str] = set()
    # A census reads every worker's references (tens of ms, more on a loaded machine): a short request whose
    # objects all lived between two readings leaves nothing to follow, and is asked again (3 tries).
    for _ in range(CENSUS_TRIES):
        known = objects_of_at_least(graph.address, SEEN_MIN_BYTES)
        done = threading.Event()

        def census(known: dict[str, int] = known, done: threading.Event = done) -> None:  # while the request runs
            while not done.is_set():
                seen.update(set(objects_of_at_least(graph.address, SEEN_MIN_BYTES)) - set(known))
                done.wait(0.02)

        watcher = threading.Thread(target=census, daemon=True)
        watcher.start()
        try:
            ask(graph, family)
        finally:
            done.set()
            watcher.join()
        if seen or len(stages) == 1:
            break
    after = stage_stats(graph, family)
    assert graph.handle("ingress").payload_loads.remote().result() == ingress_before, family.name  # by reference
    for name in stages[1:]:  # every downstream stage loaded its upstream's handoffs itself
        grew = sum(after[name]["payload_loads"].values()) - sum(before[name]["payload_loads"].values())
        assert grew >= 1, (family.name, name)
    # A lone stage's reply may travel inline in its call's return (no object to follow); a handoff cannot.
    assert seen or len(stages) == 1, f"{family.name}: the request made no object of {SEEN_MIN_BYTES}+ bytes to follow"

    def left() -> int:
        return len(seen & set(objects_of_at_least(graph.address, SEEN_MIN_BYTES)))

    deadline = time.monotonic() + FREED_WITHIN_S
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left() == 0, f"{family.name}: {left()} of the request's {len(seen)} objects outlived it"


def client_gone_cancels_every_stage(graph: Any, family: Family) -> None:
    stages = stage_names(family)

    def idle() -> bool:
        return all(
            s.get("running", 0) == 0 and s.get("waiting", 0) == 0 and s.get("stream_calls", 0) == 0
            for s in stage_stats(graph, family).values()
        )

    wait_until(idle, 90, f"{family.name}: idle stages before the test")
    before = stage_stats(graph, family)
    leave = _leaving(graph, family)
    try:
        # Every stage called, and one of them working on it (not still queued in its engine) when the client leaves.
        running = wait_until(
            lambda: _reached_every_stage(stage_stats(graph, family), before),
            120,
            f"{family.name}: the request to reach every stage and run in one",
        )
    finally:
        leave()
    wait_until(idle, 90, f"{family.name}: every stage to drop the request after the client left")
    after = stage_stats(graph, family)
    for name in stages:
        assert after[name]["calls"] >= before[name]["calls"] + 1, (family.name, name)
    # The stages it was running in aborted their engine requests (the long one: the talker at least).
    aborted = {n for n in running if after[n].get("aborted", 0) > before[n].get("aborted", 0)}
    assert aborted and aborted <= running, (family.name, running, aborted)


def _reached_every_stage(now: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> set[str] | None:
    """The stages running the request (its engine's requests, or a stream), once it reached every stage."""
    if any(s["calls"] <= before[n]["calls"] for n, s in now.items()):
        return None
    return {n for n, s in now.items() if s.get("running", 0) or s.get("stream_calls", 0)} or None


def readiness_per_stage(graph: Any, family: Family) -> None:
    health = httpx.get(f"{graph.base_url}/health", timeout=30)
    assert health.status_code == 200, health.text
    assert health.json()["stages"] == dict.fromkeys(stage_names(family), "ready"), family.name


def ask(graph: Any, family: Family) -> None:
    """One short request, answered: a job family's job made, waited for, its content downloaded, then deleted."""
    with httpx.Client(base_url=graph.base_url, timeout=300) as client:
        reply = client.post(family.route, json=family.body(False))
        assert reply.status_code == 200, reply.text
        if not family.jobs:
            return
        job = f"{family.route}/{reply.json()['id']}"
        done = wait_until(lambda: _finished(client.get(job).json()), 300, f"{family.name}: its job to finish")
        assert done["status"] == "completed", done
        assert client.get(f"{job}/content").status_code == 200
        assert client.delete(job).status_code == 200


def _finished(job: dict[str, Any]) -> dict[str, Any] | None:
    return job if job["status"] in ("completed", "failed") else None


def _leaving(graph: Any, family: Family) -> Callable[[], None]:
    """Start the long request; returns how its client leaves: its socket closed, or (a job) its job deleted."""
    if not family.jobs:
        return _open(graph.base_url, family.route, family.body(True)).close
    created = httpx.post(f"{graph.base_url}{family.route}", json=family.body(True), timeout=60)
    assert created.status_code == 200, created.text
    job = f"{graph.base_url}{family.route}/{created.json()['id']}"
    return lambda: httpx.delete(job, timeout=60).raise_for_status()


def _open(base_url: str, route: str, body: dict[str, Any]) -> socket.socket:
    """Send the request on a raw socket, so the test decides when the client goes away."""
    import json
    from urllib.parse import urlparse

    url = urlparse(base_url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=120)
    head = (
        f"POST {route} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


PROPERTIES: tuple[Callable[[Any, Family], None], ...] = (
    one_deployment_per_stage,
    handoffs_by_reference_and_freed,
    client_gone_cancels_every_stage,
    readiness_per_stage,
)
