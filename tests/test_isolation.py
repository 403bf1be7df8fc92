"""One client cannot touch another's request, and readiness never waits behind request work.

The tiny graph runs here with one replica per stage and the transformers engine's step pacing
``min_step_s`` (a minimum time per decoding step, cut short by an abort; set by each stage's
``user_config``), so requests stay in flight for certain: the windows below are held open by the
engines, not hoped for. It is deployed from scratch (``fresh``), to watch ``/health`` as it starts.

- Two clients send the same ``X-Request-ID``; one hangs up while both have calls in the same
  thinker replica (one running, one waiting in the engine). The other's reply must equal the
  same request run alone (same seed).
- While every stage has a full replica (a call sent to it now would queue), ``/health`` still
  answers 200 at once; during start-up it answers 503 naming the stages still loading.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import pytest

from tests.conftest import HTTP_PORT, graph_variant, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.tiny_variant(2)]  # replaces the graph: watches it start

BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
STAGES = ("thinker", "talker", "code2wav")
DELAY_S = {"thinker": 0.05, "talker": 0.05, "code2wav": 1.0}  # per decoding step (code2wav: per chunk)
MAX_ONGOING = {"thinker": 4, "talker": 1, "code2wav": 1}


SLOW_SINGLE_REPLICAS = graph_variant(
    fixed_replicas=1,
    deployments={
        name: {"max_ongoing_requests": n, "user_config": {"min_step_s": DELAY_S[name]}}
        for name, n in MAX_ONGOING.items()
    },
)


@pytest.fixture(scope="module")
def startup(graphs) -> list[tuple[int, dict[str, Any] | str, float]]:
    """Deploy the slow graph and poll /health from the moment `serve run` returns until it is 200."""
    graphs.deploy("tiny_omni.yaml", SLOW_SINGLE_REPLICAS, fresh=True)
    seen: list[tuple[int, dict[str, Any] | str, float]] = []
    with httpx.Client(base_url=BASE_URL, timeout=10) as http:

        def healthy() -> bool:
            started = time.monotonic()
            try:
                reply = http.get("/health")
            except httpx.TransportError:
                return False
            is_json = reply.headers.get("content-type", "").startswith("application/json")
            seen.append((reply.status_code, reply.json() if is_json else reply.text, time.monotonic() - started))
            return reply.status_code == 200

        wait_until(healthy, 300, lambda: f"/health to answer 200 (last answers: {seen[-3:]})", interval_s=0.1)
    return seen


def test_startup_health_answers_503_naming_loading_stages(startup: list) -> None:
    assert startup and startup[-1][0] == 200, startup[-3:]
    # Before the ingress runs, Serve's proxy answers itself, in plain text (404 unrouted, 503 unavailable).
    serves = {(code, body) for code, body, _ in startup if not isinstance(body, dict)}
    assert {code for code, _ in serves} <= {404, 503}, serves
    ours = [(code, body, seconds) for code, body, seconds in startup if isinstance(body, dict)]
    loading = [body for code, body, _ in ours if code == 503]
    assert loading, f"never saw the graph loading: {startup[:5]}"
    for body in loading:
        assert body["status"] == "unavailable" and set(body["stages"]) == set(STAGES)
        assert set(body["stages"].values()) <= {"ready", "loading"} and "loading" in body["stages"].values()
        assert "loading:" in body["message"]
    print(f"start-up /health: Serve answered {sorted(serves)}; the ingress answered {len(loading)} x 503, seconds")
    print("per answer, in order:", [round(seconds, 3) for _, _, seconds in ours])


def _text_request(seed: int, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny-qwen3-omni",
        "messages": [{"role": "user", "content": "Tell me something."}],
        "temperature": 1.0,
        "max_tokens": max_tokens,
        "seed": seed,
        "stream": stream,
    }


def thinker_engine(graphs) -> dict[str, Any]:
    return graphs.handle("thinker").stats.remote().result()


def test_a_shared_request_id_cannot_cut_another_clients_reply(startup, graphs) -> None:
    alone = httpx.post(f"{BASE_URL}/v1/chat/completions", json=_text_request(3, 30), timeout=120)
    assert alone.status_code == 200, alone.text
    shared = {"x-request-id": "same-id-for-both"}
    with (
        httpx.Client(base_url=BASE_URL, timeout=120) as leaver,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        with leaver.stream("POST", "/v1/chat/completions", json=_text_request(4, 400, True), headers=shared) as a:
            assert a.status_code == 200
            lines = a.iter_lines()
            while not next(lines).startswith('data: {"id"'):  # A is generating in the thinker
                pass
            b = pool.submit(
                httpx.post, f"{BASE_URL}/v1/chat/completions", json=_text_request(3, 30), headers=shared, timeout=120
            )
            # B is in the same thinker replica, waiting in its engine behind A: both calls in flight.
            wait_until(
                lambda: (state := thinker_engine(graphs))["waiting"] >= 1 and state["running"] >= 1,
                60,
                "B to reach the thinker's engine",
                interval_s=0.05,
            )
            # A hangs up here: its stage calls are cancelled and the thinker aborts A's engine request.
        reply = b.result()
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == alone.json()["choices"][0]["message"]["content"]
    assert reply.json()["usage"] == alone.json()["usage"]
    assert reply.json()["choices"][0]["finish_reason"] == alone.json()["choices"][0]["finish_reason"]


def _audio_request() -> dict[str, Any]:
    return {
        "model": "tiny-qwen3-omni",
        "messages": [{"role": "user", "content": "Hi"}],
        "modalities": ["text", "audio"],
        "max_tokens": 2,
        "stream": True,
        "stage_sampling": {"talker": {"temperature": 0.0, "max_tokens": 300}},
    }


def test_health_stays_200_while_every_stage_is_saturated(startup, graphs) -> None:
    """Saturated = a call sent to the stage now does not start: a ``stats`` call sent just before
    ``/health`` is still pending on every stage after ``/health`` answered 200."""
    with (
        httpx.Client(base_url=BASE_URL, timeout=120) as http,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        with http.stream("POST", "/v1/chat/completions", json=_audio_request()) as talking:
            lines = talking.iter_lines()
            while '"modality":"audio"' not in next(lines):  # the talker streams, code2wav decodes
                pass
            pool.submit(httpx.post, f"{BASE_URL}/v1/chat/completions", json={**_audio_request(), "stream": False})
            for seed in range(6):  # more long text requests than the thinker takes at once
                pool.submit(httpx.post, f"{BASE_URL}/v1/chat/completions", json=_text_request(seed, 100), timeout=120)

            def health_while_saturated() -> dict[str, Any] | None:
                probes = {stage: graphs.handle(stage).stats.remote() for stage in STAGES}
                health = http.get("/health")
                pending = []
                for stage, probe in probes.items():
                    try:
                        probe.result(timeout_s=0)
                    except TimeoutError:
                        pending.append(stage)
                assert health.status_code == 200, health.text
                for probe in probes.values():  # one probe per stage at a time (the handle's queue is bounded)
                    assert probe.result(timeout_s=300)["stage"] in STAGES
                return health.json() if len(pending) == len(STAGES) else None

            observed = wait_until(health_while_saturated, 90, "every stage saturated at once", interval_s=0)
            assert observed == {"status": "ok", "stages": dict.fromkeys(STAGES, "ready")}
