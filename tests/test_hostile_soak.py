"""Every hostile client at once beside seeded victims, on the tiny omni graph's one ingress replica, for
:data:`SOAK_S` seconds (tests/hostile.py's soak; benchmarks/hostile_soak.py runs it longer and times it):

- a realtime client sending the worst events allowed: the largest ``session.update`` it may (tools up to
  the event's bytes), then empty updates at the allowed event rate with odd types among them
  (``{"type": []}``, numbers, arrays);
- a page posting forms cross-site (``Origin: http://evil.example``): multipart, urlencoded, text/plain
  and JSON bodies to every route that does work;
- chat requests with a new ``response_format`` schema each (a new grammar to compile each time).

What must hold, latency aside (a timing is never this suite's assertion: the benchmark prints the victims'
quiet and soak p50): the victims' seeded chat (text and audio) and speech replies stay byte-identical to
their first; every cross-site post is refused with 403 and runs no stage; the realtime client gets an
answer to every event, no close but a documented limit, and answers within its byte budget (no echo
amplification); every new-schema chat is served; no call hangs; and once the graph settled, the memory
of every replica (ingress and stages) is where it was before the soak, within :data:`RSS_TOLERANCE`
(the thinker's compiled-grammar cache bounded small for it: :data:`GRAMMAR_CACHE_MB`), each replica's allocator
trimmed before both readings (tests/hostile.py's ``trim_replicas``: what it frees but keeps for reuse is not
growth; what it still refers to is).

The baseline is taken after a warm-up that ran each abuser once (the largest update and a few echoes,
one round of forms, one schema), so what a first use allocates for good (a parser, a compiler, the
allocator's high-water mark) is in it and the comparison is growth under abuse only.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from omni_serve.graph.config import RealtimeConfig
from tests import hostile
from tests.conftest import graph_variant, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.tiny_variant(0)]  # options only: in place

SOAK_S = 45
WARM_UP_S = 3  # the realtime abuser's warm-up: its largest update and a few echoes
LIMITS = RealtimeConfig()  # the tiny graph sets no realtime bounds: the defaults
RSS_TOLERANCE = 64 << 20  # per replica: allocator slack; a cache or a session's bytes kept grows past it
# One replica a deployment (the victims share the one ingress replica with every abuser), and the thinker's
# compiled-grammar cache bounded at 16 MiB (vLLM's setting, which omni_serve's xgrammar cache follows): a new
# schema's grammar holds ~2.3 MiB of the tiny checkpoint's vocabulary, so at the default bound (512 MiB) the
# cache would grow through the whole soak by design, and at 16 MiB an unbounded one shows within it.
GRAMMAR_CACHE_MB = 16
SMALL_GRAMMAR_CACHE = graph_variant(
    fixed_replicas=1,
    deployments={
        "thinker": {
            "ray_actor_options": {"runtime_env": {"env_vars": {"VLLM_XGRAMMAR_CACHE_MB": str(GRAMMAR_CACHE_MB)}}}
        }
    },
)


@dataclass
class Soaked:
    card: dict[str, Any]
    quiet_forms: dict[tuple[str, str], int]  # the warm-up's round of cross-site posts, nothing else running
    quiet_calls: tuple[dict[str, int], dict[str, int]]  # stage calls before and after that round
    soak: hostile.Soak
    rss: tuple[dict[str, int], dict[str, int]]  # every replica's, before the soak and once settled after it
    left: dict[str, Any]  # what the census found left in the object stores


@pytest.fixture(scope="module")
def graph(graphs: Any) -> Any:
    graphs.ensure("tiny_omni.yaml", SMALL_GRAMMAR_CACHE)
    return graphs


def realtime_sessions(graph: Any) -> int:
    return int(graph.handle("ingress").realtime_stats.remote().result()["sessions"])


def settle(graph: Any, stages: list[str]) -> None:
    wait_until(lambda: hostile.stages_idle(stages), 120, "idle stages")
    wait_until(lambda: realtime_sessions(graph) == 0, 60, "every realtime session to end")


@pytest.fixture(scope="module")
def soaked(graph: Any) -> Soaked:
    card = hostile.model_card(graph.base_url)
    stages = card["stages"]
    settle(graph, stages)
    targets = hostile.victims(graph.base_url, card)
    for victim in targets:  # quiet: the solo reply, then once more
        victim.take("quiet")
        victim.take("quiet")
    # Warm-up, each abuser once; the cross-site round alone, so that any stage call it made would show.
    settle(graph, stages)
    before_forms = hostile.stage_calls(stages)
    quiet_forms = hostile.post_cross_site(graph.base_url, card["id"])
    after_forms = hostile.stage_calls(stages)
    httpx.post(f"{graph.base_url}/v1/chat/completions", json=hostile.schema_chat(card["id"], 0), timeout=180)
    ws_url = f"{graph.base_url.replace('http', 'ws', 1)}/v1/realtime?model={card['id']}"
    asyncio.run(hostile.realtime_abuse(ws_url, LIMITS, time.monotonic() + WARM_UP_S))
    settle(graph, stages)
    census = hostile.Census(graph.address)
    pids = hostile.replica_pids()
    hostile.trim_replicas()
    rss_before = hostile.replica_rss(pids)
    soak = hostile.run_soak(graph.base_url, card, LIMITS, SOAK_S, targets)
    settle(graph, stages)

    def clean() -> dict[str, Any] | None:
        left = census.left()
        return left if left["objects_bytes"] == 0 and not left["shm"] else None

    try:
        wait_until(clean, 30, "the object stores to free what the soak made")
    finally:
        left = census.left()
    # Steady to 8 MiB: what a replica frees after its last request (a reply's buffers) is not growth.
    hostile.wait_steady(lambda: {k: v >> 23 for k, v in hostile.replica_rss(pids).items()}, 2, 60, "replicas' memory")
    hostile.trim_replicas()
    rss_after = hostile.replica_rss(pids)
    for victim in targets:
        victim.take("after")
    print(f"\nsoak of {SOAK_S} s: {hostile.summary(soak)}")
    print({label: f"{rss_before[label] >> 20} -> {rss_after.get(label, 0) >> 20} MiB" for label in rss_before})
    return Soaked(card, quiet_forms, (before_forms, after_forms), soak, (rss_before, rss_after), left)


def test_the_victims_replies_stay_byte_identical(soaked: Soaked) -> None:
    assert all(v.seconds["soak"] for v in soaked.soak.victims), "a victim got no reply during the soak"
    assert not soaked.soak.failures(LIMITS)["identity"]


def test_cross_site_posts_are_refused_and_run_nothing(soaked: Soaked) -> None:
    before, after = soaked.quiet_calls
    refused = {key: status for key, status in soaked.quiet_forms.items() if status != 403}
    assert not refused and after == before, f"not refused with 403: {refused}; stage calls {before} -> {after}"
    assert soaked.soak.forms and not soaked.soak.failures(LIMITS)["cross_site"]


def test_the_realtime_abuser_is_answered_within_its_limits(soaked: Soaked) -> None:
    realtime = soaked.soak.realtime
    assert realtime is not None and realtime.sent, "the realtime abuser sent nothing"
    assert not realtime.failures(LIMITS), (realtime.failures(LIMITS), dict(realtime.errors))


def test_a_new_schema_per_request_is_served(soaked: Soaked) -> None:
    assert sum(soaked.soak.schemas.values()) and not soaked.soak.failures(LIMITS)["schemas"]


def test_no_call_hung(soaked: Soaked) -> None:
    assert not soaked.soak.hung


def test_every_replicas_memory_is_flat_after_the_soak(soaked: Soaked) -> None:
    before, after = soaked.rss
    assert set(after) == set(before), f"replicas changed during the soak: {sorted(before)} -> {sorted(after)}"
    mib = {label: f"{before[label] >> 20} -> {after[label] >> 20} MiB" for label in before}
    assert not hostile.grown(before, after, RSS_TOLERANCE), mib
    assert soaked.left["objects_bytes"] == 0 and not soaked.left["shm"], soaked.left
