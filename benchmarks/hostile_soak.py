"""Hostile-client soak: every abuser at once beside seeded victims on the same ingress replica.

    python benchmarks/hostile_soak.py                                # starts graphs/tiny_omni.yaml on a private
                                                                     # Ray cluster (one replica a deployment)
    python benchmarks/hostile_soak.py --url http://127.0.0.1:8000    # an omni_serve already running here
    python benchmarks/hostile_soak.py --video-url http://127.0.0.1:8001   # and a burst of video jobs on a video
                                                                     # graph running beside it (graphs/tiny_video.yaml)

The abusers are tests/hostile.py's (tests/test_hostile_soak.py runs the same soak, shorter, and asserts
everything but the timings): a realtime client sending the largest ``session.update`` it may (tools up
to the event's bytes), then empty updates at the allowed event rate with odd types among them; a page
posting forms cross-site (``Origin: http://evil.example``: multipart, urlencoded, text/plain and JSON
bodies to every route that does work); chats with a new ``response_format`` schema each; a burst of
video jobs (``--video-jobs``) where a graph makes video.

Phases: quiet (each victim alone, ``--quiet-runs`` times: its first reply is the one every later one must
equal byte for byte), warm-up (each abuser once, so what a first use allocates for good is in the memory
baseline; on a cluster it started, the stage calls around one round of cross-site posts, nothing else
running), the soak (``--seconds``; the victims asked again and again, one request at a time), settle
(stages idle, sessions closed, memory steady), the victims once more.

Prints each victim's quiet and soak p50/p90 and their ratio (#51's target: soak p50 within 1.5 x quiet;
reported, never a pass/fail: it depends on the machine), byte identity, every check's findings, and
every replica's RSS (with its children's) before and after. Exit status 1 when a victim's reply changed,
a replica's memory grew past ``--rss-tolerance-mib``, or another check failed; latency alone never fails it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench import _fixed, report  # noqa: E402
from benchmarks.soak import ray_processes  # noqa: E402
from tests import hostile  # noqa: E402

TARGET_RATIO = 1.5  # #51: the victim's soak p50 within this of its quiet p50


def soak_edit(graph: str, grammar_cache_mb: int) -> Callable[[dict[str, Any]], None]:
    """One replica a deployment (a stage's handle sees all its calls; the victims share the abusers' ingress
    replica), and each stage's compiled-grammar cache bounded at ``grammar_cache_mb`` (vLLM's
    ``VLLM_XGRAMMAR_CACHE_MB``): at the default 512 MiB the new-schema chats fill it through the whole soak by
    design, and at a small bound a cache that is not bounded shows as growth."""
    from omni_serve.cli.launch import load_graph_file

    names = {d["name"]: 1 for d in load_graph_file(graph)["applications"][0]["deployments"]}
    fixed = _fixed(names)

    def mutate(config: dict[str, Any]) -> None:
        fixed(config)
        for deployment in config["applications"][0]["deployments"]:
            if deployment["name"] != "ingress":
                options = deployment.setdefault("ray_actor_options", {})
                env = options.setdefault("runtime_env", {}).setdefault("env_vars", {})
                env["VLLM_XGRAMMAR_CACHE_MB"] = str(grammar_cache_mb)

    return mutate


@contextlib.contextmanager
def private_graph(graph: str, port: int, grammar_cache_mb: int) -> Iterator[str]:
    """``graph`` on a private Ray cluster (never one already running), edited by :func:`soak_edit`; Serve, then
    Ray, stopped on leaving."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from omni_serve.cli.launch import deploy_graph_file, wait_healthy

    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="serve", log_to_driver=False)
    try:
        deploy_graph_file(graph, ray.get_runtime_context().gcs_address, port, soak_edit(graph, grammar_cache_mb))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, replaced=True)
        yield url
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def victim_rows(victims: list[hostile.Seeded]) -> list[dict[str, Any]]:
    rows = []
    for v in victims:
        quiet, soak = v.seconds["quiet"], v.seconds["soak"]
        q50, s50 = pct(quiet, 50), pct(soak, 50)
        ratio = s50 / q50 if q50 and s50 else None
        rows.append(
            {
                "victim": v.name,
                "quiet_n": len(quiet),
                "quiet_p50_s": q50,
                "quiet_p90_s": pct(quiet, 90),
                "soak_n": len(soak),
                "soak_p50_s": s50,
                "soak_p90_s": pct(soak, 90),
                "p50_ratio": ratio,
                f"within_{TARGET_RATIO}x": None if ratio is None else ratio <= TARGET_RATIO,
                "byte_identical": not v.differed,
            }
        )
    return rows


def wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting {timeout_s:g} s for {what}")
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running omni_serve (127.0.0.1 only) instead of starting --graph")
    parser.add_argument("--graph", default="tiny_omni.yaml", help="the graph file to start (without --url)")
    parser.add_argument("--port", type=int, default=19280, help="HTTP port of the started graph")
    parser.add_argument("--video-url", help="a running video graph (127.0.0.1) for the burst of video jobs")
    parser.add_argument("--video-jobs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=90, help="how long every abuser runs at once")
    parser.add_argument("--quiet-runs", type=int, default=5, help="each victim's replies before the abuse")
    parser.add_argument("--grammar-cache-mb", type=int, default=16, help="the started graph's stages' bound")
    parser.add_argument("--rss-tolerance-mib", type=float, default=64, help="per replica, after the settle")
    parser.add_argument("--out", default="benchmarks/results_hostile_soak.json")
    args = parser.parse_args()
    for url in (args.url, args.video_url):
        if url and urlparse(url).hostname not in ("127.0.0.1", "localhost"):
            parser.error("--url and --video-url must point at 127.0.0.1: this tool only loads the local machine")
    with (
        contextlib.nullcontext(args.url)
        if args.url
        else private_graph(args.graph, args.port, args.grammar_cache_mb) as url
    ):
        return soak(args, url, driver=not args.url)


def soak(args: argparse.Namespace, url: str, driver: bool) -> int:
    from omni_serve.graph.config import RealtimeConfig

    limits = RealtimeConfig()  # what the tiny graphs deploy; a graph with its own bounds is soaked against these
    card = hostile.model_card(url)
    stages = card["stages"]
    victims = hostile.victims(url, card)
    findings: dict[str, Any] = {}

    def replicas() -> dict[str, int]:  # this cluster's when started here, else every Serve replica on the machine
        return (
            hostile.replica_pids()
            if driver
            else {k: v for k, v in ray_processes(None).items() if not k.startswith(("controller#", "proxy#"))}
        )

    def settle() -> None:
        if driver:
            wait(lambda: hostile.stages_idle(stages), 300, "idle stages")
        time.sleep(5)  # the last replies' buffers freed, the realtime sessions closed

    print(f"quiet: {args.quiet_runs} replies of each victim ({', '.join(v.name for v in victims)})", flush=True)
    for _ in range(args.quiet_runs):
        for victim in victims:
            victim.take("quiet")
    print("warm-up: each abuser once", flush=True)
    settle()
    calls = hostile.stage_calls(stages) if driver else None
    quiet_forms = hostile.post_cross_site(url, card["id"])
    if calls is not None:
        findings["cross_site_stage_calls"] = {"before": calls, "after": hostile.stage_calls(stages)}
    findings["cross_site_quiet"] = {f"{r} {k}": s for (r, k), s in quiet_forms.items()}
    httpx.post(f"{url}/v1/chat/completions", json=hostile.schema_chat(card["id"], 0), timeout=180)
    if "/v1/realtime" in card["routes"]:
        ws_url = f"{url.replace('http', 'ws', 1)}/v1/realtime?model={card['id']}"
        asyncio.run(hostile.realtime_abuse(ws_url, limits, time.monotonic() + 3))
    settle()
    pids = replicas()
    rss_before = hostile.replica_rss(pids)
    print(f"soak: {args.seconds:g} s, every abuser at once, beside the victims", flush=True)
    result = hostile.run_soak(url, card, limits, args.seconds, victims, args.video_jobs, args.video_url)
    settle()
    rss_after = hostile.replica_rss(pids)
    for victim in victims:
        victim.take("after")
    failures = result.failures(limits)
    tolerance = int(args.rss_tolerance_mib * 2**20)
    failures["memory"] = [
        f"{k}: +{v / 2**20:.0f} MiB" for k, v in hostile.grown(rss_before, rss_after, tolerance).items()
    ]
    failures["cross_site"] += [
        f"quiet {key}: {status}" for key, status in findings["cross_site_quiet"].items() if status != 403
    ]
    if calls is not None and findings["cross_site_stage_calls"]["after"] != calls:
        failures["cross_site"].append(f"a cross-site post ran a stage: {findings['cross_site_stage_calls']}")
    rows = victim_rows(victims)
    report(args, rows, cols=list(rows[0]))
    print("\n| replica | RSS before MiB | RSS after MiB | delta |\n|---|---|---|---|")
    for label in sorted(rss_before):
        a, b = rss_before[label] / 2**20, rss_after.get(label, 0) / 2**20
        print(f"| {label} | {a:.0f} | {b:.0f} | {b - a:+.0f} |")
    print(f"\n{hostile.summary(result)}")
    print("\nchecks (latency aside):")
    ran = {"realtime": result.realtime is not None, "videos": result.videos is not None}
    for check, found in failures.items():
        said = "not run (the graph has no such route)" if not ran.get(check, True) else "held"
        print(f"  {check}: {said if not found else '; '.join(found)[:600]}")
    with open(args.out) as f:
        saved = json.load(f)
    saved.update(rss_before=rss_before, rss_after=rss_after, failures=failures, findings=findings)
    with open(args.out, "w") as f:
        json.dump(saved, f, indent=2, default=str)
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
