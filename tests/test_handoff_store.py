"""The object store under text+audio load with production-sized (>= 1 MiB) handoffs.

The tiny graph runs with every handoff padded by 1 MiB (the stages' debug option ``handoff_padding_bytes``,
set as a run-time setting), so each request moves four >= 1 MiB payloads: the thinker's, and one per codec
chunk (4 + 25 + 1 frames). A watcher samples the object stores' bytes (what ``ray memory
--stats-only`` reads) throughout. What must hold:

- while requests run, the store holds no more than what the requests in flight hold;
- within 10 s after the last request ended (finished, failed, client gone, or served by a
  replica that died), no process refers to a handoff any more (the ``ray memory`` table):
  handoff bytes pinned are back at their idle baseline, zero. No timer, no leak.
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any, NamedTuple

import httpx
import pytest

from tests.conftest import wait_until
from tests.faults import BODY as FAULTS_BODY
from tests.faults import CLIENT_TIMEOUT_S, SHARED_GRAPH, TWO_PADDED_TALKERS, samples
from tests.faults import HANDOFF_PADDING as PADDING
from tests.object_store import (
    StoreWatch,
    new_object_bytes,
    object_store_bytes,
    objects_of_at_least,
    settled,
    wait_at_most,
)

pytestmark = [pytest.mark.integration, SHARED_GRAPH, pytest.mark.tiny_variant(0)]

TALKER_FRAMES = 30  # greedy: the tiny talker never samples codec EOS, so always chunks of 4 + 25 + 1 frames
HANDOFFS_PER_REQUEST = 1 + 3  # the thinker's, one per codec chunk
# Besides its handoffs' padding, an in-flight request holds a few small objects: its payloads'
# real tensors, the audio chunks code2wav streams back, the reply the proxy streams out.
OTHER_BYTES_PER_REQUEST = 1 << 20
FREED_WITHIN_S = 10
BODY = {**FAULTS_BODY, "stage_sampling": {"talker": {"temperature": 0.0, "max_tokens": TALKER_FRAMES}}}


@pytest.fixture(scope="module")
def graph(graphs: Any) -> Any:
    graphs.ensure("tiny_omni.yaml", TWO_PADDED_TALKERS)  # tests/test_faults.py's deploy
    return graphs


class Idle(NamedTuple):
    """The object store with the graph up and no request ever sent to it."""

    bytes: int
    large_objects: dict[str, int]  # >= PADDING: whatever they are, not handoffs (there were none yet)


@pytest.fixture(scope="module")
def idle(graph: Any, ray_cluster: str) -> Idle:
    return Idle(settled(lambda: object_store_bytes(ray_cluster)), objects_of_at_least(ray_cluster, PADDING))


def assert_no_handoff_left(idle: Idle, gcs_address: str) -> None:
    """Within FREED_WITHIN_S, no process refers to a handoff-sized object any more: the handoff bytes
    pinned are back at their idle baseline, zero. (The store's total also moves with Serve's own
    small objects, e.g. those of a replica that replaces a killed one.)"""
    held, waited = wait_at_most(lambda: new_object_bytes(gcs_address, PADDING, idle.large_objects), 0, FREED_WITHIN_S)
    assert held == 0, f"{held} B of handoffs still pinned {waited:.0f} s after the last request"
    print(f"no handoff left {waited:.2f} s after the last request")


def one_request(base_url: str, kind: str) -> dict[str, Any]:
    """``ok`` / ``stream``: complete replies; ``bad_voice``: fails in the talker after the thinker's
    handoff exists; ``gone``: a streaming client that hangs up after the first audio chunk."""
    body = {**BODY, "stream": kind in ("stream", "gone")}
    if kind == "bad_voice":
        body["audio"] = {"format": "wav", "voice": "nobody"}
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        if not body["stream"]:
            reply = client.post(f"{base_url}/v1/chat/completions", json=body)
            if reply.status_code != 200:
                return {"kind": kind, "status": reply.status_code, "error": reply.json()["error"]}
            message = reply.json()["choices"][0]["message"]
            return {"kind": kind, "status": 200, "samples": samples(message["audio"]["data"])}
        events: list[str] = []
        with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if kind == "gone" and '"modality":"audio"' in line:
                        break  # leaving the block closes the connection mid-stream
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        audio = [c["choices"][0]["delta"]["audio"]["data"] for c in chunks if c.get("modality") == "audio"]
        return {
            "kind": kind,
            "status": reply.status_code,
            "done": events[-1] == "[DONE]" if events else False,
            "errors": [c["error"] for c in chunks if "error" in c],
            "samples": sum(samples(a) for a in audio),
        }


def run_wave(base_url: str, kinds: list[str], during: Any = None) -> list[dict[str, Any]]:
    with concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:
        futures = [pool.submit(one_request, base_url, kind) for kind in kinds]
        if during is not None:
            during()
        return [f.result() for f in futures]


@pytest.fixture(scope="module")
def full_samples(graph: Any, idle: Idle) -> int:
    """Audio samples of the complete reply (and a warm graph)."""
    reference = one_request(graph.base_url, "ok")
    assert reference["status"] == 200, reference
    return reference["samples"]


def test_handoffs_live_while_requests_need_them(graph: Any, ray_cluster: str, idle: Idle, full_samples: int) -> None:
    kinds = ["ok", "ok", "ok", "stream", "bad_voice", "gone"]
    with StoreWatch(ray_cluster) as watch:
        outcomes = run_wave(graph.base_url, kinds)
    by_kind = {o["kind"]: o for o in outcomes}
    assert all(o["samples"] == full_samples for o in outcomes if o["kind"] == "ok"), outcomes
    stream = by_kind["stream"]
    assert stream["done"] and not stream["errors"] and stream["samples"] == full_samples, stream
    assert by_kind["bad_voice"]["status"] == 400 and "nobody" in by_kind["bad_voice"]["error"]["message"]
    assert 0 < by_kind["gone"]["samples"] < full_samples and not by_kind["gone"]["done"]

    pinned = watch.peak - idle.bytes  # all objects: an upper bound of the handoffs' bytes
    in_flight_bound = len(kinds) * (HANDOFFS_PER_REQUEST * PADDING + OTHER_BYTES_PER_REQUEST)
    print(f"object store: idle {idle.bytes} B, peak +{pinned} B over {watch.samples} samples")
    assert pinned >= PADDING, "no handoff ever reached the object store: the check below would be empty"
    assert pinned <= in_flight_bound, f"{pinned} B pinned; {len(kinds)} requests in flight hold <= {in_flight_bound}"
    assert_no_handoff_left(idle, ray_cluster)
    # No replica came or went: the store's total is back too (less than one handoff of slack).
    held, _ = wait_at_most(lambda: object_store_bytes(ray_cluster), idle.bytes + PADDING // 4, FREED_WITHIN_S)
    assert held <= idle.bytes + PADDING // 4, f"the store holds {held - idle.bytes} B more than when idle"


def test_a_dying_talker_replica_leaks_no_handoff(graph: Any, ray_cluster: str, idle: Idle, full_samples: int) -> None:
    import ray

    prefix = "SERVE_REPLICA::omni#talker#"
    talkers = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))
    assert len(talkers) == 2
    code2wav = graph.handle("code2wav")
    before = code2wav.stats.remote().result()["requests_total"]

    def kill_a_talker_under_load() -> None:
        wait_until(
            lambda: code2wav.stats.remote().result()["requests_total"] >= before + 3, 60, "the load to reach code2wav"
        )
        ray.kill(ray.get_actor(talkers[0], namespace="serve"), no_restart=True)

    outcomes = run_wave(graph.base_url, ["ok"] * 6, during=kill_a_talker_under_load)
    # Requests the dead replica served fail cleanly (503) or were retried elsewhere; no other
    # request's handoffs were touched: every success is the complete reply.
    assert all(o["status"] in (200, 503) for o in outcomes), outcomes
    assert all(o["samples"] == full_samples for o in outcomes if o["status"] == 200), outcomes
    assert any(o["status"] == 200 for o in outcomes)
    assert_no_handoff_left(idle, ray_cluster)
