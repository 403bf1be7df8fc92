"""Hostile-client soak: every abuser at once beside seeded victims on the same ingress replica.

    python benchmarks/hostile_soak.py                                # starts graphs/tiny_omni.yaml on a private
                                                                     # Ray cluster (one replica a deployment)
    python benchmarks/hostile_soak.py --url http://127.0.0.1:8000    # an omni_serve already running here
    python benchmarks/hostile_soak.py --video-url http://127.0.0.1:8001   # and a burst of video jobs on a video
                                                                     # graph running beside it (graphs/tiny_video.yaml)
    python benchmarks/hostile_soak.py --only none --only realtime --only schemas --only cross-site
                                                                     # one soak phase each, in turn: which abuser
                                                                     # costs the victims what ("none": victims alone)

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

With ``--only`` (repeatable; a comma-separated set of ``tests/hostile.py``'s ``ABUSERS``, or ``none``) the soak
runs once per value, one after the other on the same graph, each phase timed and reported on its own; without
it, one phase with every abuser. Each phase also reports where the CPU went: every Serve replica's, the proxy's,
HAProxy's, Ray's own processes' and this process's (the clients') CPU seconds over the phase, from psutil.

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
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench import _graph_edit, parse_paces, report  # noqa: E402
from benchmarks.soak import ray_processes  # noqa: E402
from tests import hostile  # noqa: E402

TARGET_RATIO = 1.5  # #51: the victim's soak p50 within this of its quiet p50


def soak_edit(
    graph: str, grammar_cache_mb: int, pace: dict[str, float] | None = None
) -> Callable[[dict[str, Any]], None]:
    """One replica a deployment (a stage's handle sees all its calls; the victims share the abusers' ingress
    replica), each stage's compiled-grammar cache bounded at ``grammar_cache_mb`` (vLLM's
    ``VLLM_XGRAMMAR_CACHE_MB``): at the default 512 MiB the new-schema chats fill it through the whole soak by
    design, and at a small bound a cache that is not bounded shows as growth; and ``pace``'s stages paced
    (``min_step_s``, omni_serve.pacing)."""
    from omni_serve.cli.launch import load_graph_file

    names = {d["name"]: 1 for d in load_graph_file(graph)["applications"][0]["deployments"]}
    fixed = _graph_edit(names, pace=pace)

    def mutate(config: dict[str, Any]) -> None:
        fixed(config)
        for deployment in config["applications"][0]["deployments"]:
            if deployment["name"] != "ingress":
                options = deployment.setdefault("ray_actor_options", {})
                env = options.setdefault("runtime_env", {}).setdefault("env_vars", {})
                env["VLLM_XGRAMMAR_CACHE_MB"] = str(grammar_cache_mb)

    return mutate


@contextlib.contextmanager
def private_graph(graph: str, port: int, grammar_cache_mb: int, pace: dict[str, float] | None) -> Iterator[str]:
    """``graph`` on a private Ray cluster (never one already running), edited by :func:`soak_edit`; Serve, then
    Ray, stopped on leaving."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from omni_serve.cli.launch import deploy_graph_file, wait_healthy

    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="serve", log_to_driver=False)
    try:
        deploy_graph_file(graph, ray.get_runtime_context().gcs_address, port, soak_edit(graph, grammar_cache_mb, pace))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, replaced=True)
        yield url
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def process_label(process: Any) -> str | None:
    """What a process of the machine is to the soak (None: not the server's, nor this benchmark's)."""
    import psutil

    if process.pid == os.getpid():
        return "bench (the clients)"
    try:
        title = " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if replica := re.match(r"ray::(?:ServeReplica:[^:]+:|SERVE_REPLICA::[^#]+#)([\w-]+)", title):
        return replica.group(1)
    if actor := re.match(r"ray::(\w+)", title):
        return {"ProxyActor": "proxy", "ServeController": "controller"}.get(actor.group(1), f"ray {actor.group(1)}")
    if "haproxy" in title.split(" ", 1)[0]:
        return "haproxy"
    if re.search(r"(raylet|gcs_server|ray/dashboard|ray/_private)", title):
        return "ray (raylet, gcs, agents)"
    return None


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (label, user + system CPU seconds so far) of every process :func:`process_label` names."""
    import psutil

    found = {}
    for process in psutil.process_iter():
        label = process_label(process)
        if label is None:
            continue
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found[process.pid] = (label, times.user + times.system)
    return found


def machine_busy_s() -> float:
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def cpu_rows(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], busy_s: float, wall_s: float
) -> list[dict[str, Any]]:
    """CPU seconds each kind of process used between two :func:`cpu_seconds` (a process started meanwhile counts
    from 0), most first; the machine's busy seconds and what no process named here used, last."""
    used: dict[str, float] = {}
    for pid, (label, seconds) in after.items():
        used[label] = used.get(label, 0.0) + seconds - before.get(pid, (label, 0.0))[1]
    rows = [{"process": k, "cpu_s": v, "cores": v / wall_s} for k, v in sorted(used.items(), key=lambda kv: -kv[1])]
    rows.append({"process": "anything else", "cpu_s": busy_s - sum(used.values()), "cores": None})
    rows.append({"process": "the machine", "cpu_s": busy_s, "cores": busy_s / wall_s})
    return rows


def pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def victim_rows(victims: list[hostile.Seeded], phase: str = "soak") -> list[dict[str, Any]]:
    rows = []
    for v in victims:
        quiet, soak = v.seconds["quiet"], v.seconds.get(phase, [])
        q50, s50 = pct(quiet, 50), pct(soak, 50)
        ratio = s50 / q50 if q50 and s50 else None
        rows.append(
            {
                "phase": phase,
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


def abuser_set(text: str) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n and n != "none")
    unknown = set(names) - set(hostile.ABUSERS)
    if unknown:
        raise argparse.ArgumentTypeError(f"no such abuser {', '.join(sorted(unknown))} (of {hostile.ABUSERS})")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running omni_serve (127.0.0.1 only) instead of starting --graph")
    parser.add_argument("--graph", default="tiny_omni.yaml", help="the graph file to start (without --url)")
    parser.add_argument("--port", type=int, default=19280, help="HTTP port of the started graph")
    parser.add_argument("--video-url", help="a running video graph (127.0.0.1) for the burst of video jobs")
    parser.add_argument("--video-jobs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=90, help="how long every abuser runs at once")
    parser.add_argument(
        "--only",
        action="append",
        type=abuser_set,
        help=f"a soak phase of only these abusers (comma-separated: {', '.join(hostile.ABUSERS)}; or none); "
        "repeat for phases one after the other (default: one phase, every abuser)",
    )
    parser.add_argument("--quiet-runs", type=int, default=5, help="each victim's replies before the abuse")
    parser.add_argument("--grammar-cache-mb", type=int, default=16, help="the started graph's stages' bound")
    parser.add_argument(
        "--pace",
        type=parse_paces,
        help="the started graph's stages paced: min_step_s per stage, e.g. thinker=0.05,talker=0.1,code2wav=0.1 "
        "(each stage's steps as if on an accelerator of its own; above the CPU's own step time, only queueing shows)",
    )
    parser.add_argument("--rss-tolerance-mib", type=float, default=64, help="per replica, after the settle")
    parser.add_argument("--out", default="benchmarks/results_hostile_soak.json")
    args = parser.parse_args()
    for url in (args.url, args.video_url):
        if url and urlparse(url).hostname not in ("127.0.0.1", "localhost"):
            parser.error("--url and --video-url must point at 127.0.0.1: this tool only loads the local machine")
    with (
        contextlib.nullcontext(args.url)
        if args.url
        else private_graph(args.graph, args.port, args.grammar_cache_mb, args.pace) as url
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
    if driver:  # this cluster's replicas: their allocators trimmed before each reading (hostile.trim_replicas)
        hostile.trim_replicas()
    rss_before = hostile.replica_rss(pids)
    failures: dict[str, list[str]] = {}
    rows: list[dict[str, Any]] = []
    cpu: dict[str, list[dict[str, Any]]] = {}
    summaries: list[str] = []
    ran = {"realtime": False, "videos": False}
    for abusers in args.only or [hostile.ABUSERS]:
        phase = "soak" if not args.only else f"soak: {','.join(abusers) or 'none'}"
        print(f"{phase}: {args.seconds:g} s, {', '.join(abusers) or 'no abuser'} beside the victims", flush=True)
        cpu_before, busy_before, started = cpu_seconds(), machine_busy_s(), time.monotonic()
        result = hostile.run_soak(
            url, card, limits, args.seconds, victims, args.video_jobs, args.video_url, abusers, phase
        )
        wall_s = time.monotonic() - started
        cpu[phase] = cpu_rows(cpu_before, cpu_seconds(), machine_busy_s() - busy_before, wall_s)
        rows += victim_rows(victims, phase)
        summaries.append(f"{phase}: {hostile.summary(result, phase)}")
        ran["realtime"] |= result.realtime is not None
        ran["videos"] |= result.videos is not None
        for check, found in result.failures(limits).items():
            failures.setdefault(check, []).extend(found)
        settle()
    if driver:
        hostile.trim_replicas()
    rss_after = hostile.replica_rss(pids)
    for victim in victims:
        victim.take("after")
    tolerance = int(args.rss_tolerance_mib * 2**20)
    failures["memory"] = [
        f"{k}: +{v / 2**20:.0f} MiB" for k, v in hostile.grown(rss_before, rss_after, tolerance).items()
    ]
    failures["cross_site"] += [
        f"quiet {key}: {status}" for key, status in findings["cross_site_quiet"].items() if status != 403
    ]
    if calls is not None and findings["cross_site_stage_calls"]["after"] != calls:
        failures["cross_site"].append(f"a cross-site post ran a stage: {findings['cross_site_stage_calls']}")
    report(args, rows, cols=list(rows[0]))
    for phase, table in cpu.items():
        print(f"\nCPU seconds in {phase} ({args.seconds:g} s; 'cores': CPU seconds per second)")
        print("| process | CPU s | cores |\n|---|---|---|")
        for row in table:
            cores = "" if row["cores"] is None else f"{row['cores']:.2f}"
            print(f"| {row['process']} | {row['cpu_s']:.1f} | {cores} |")
    print("\n| replica | RSS before MiB | RSS after MiB | delta |\n|---|---|---|---|")
    for label in sorted(rss_before):
        a, b = rss_before[label] / 2**20, rss_after.get(label, 0) / 2**20
        print(f"| {label} | {a:.0f} | {b:.0f} | {b - a:+.0f} |")
    print("\n" + "\n".join(summaries))
    print("\nchecks (latency aside):")
    for check, found in failures.items():
        said = "held" if ran.get(check, True) else "not run (not among the abusers run, or no such route)"
        print(f"  {check}: {said if not found else '; '.join(found)[:600]}")
    with open(args.out) as f:
        saved = json.load(f)
    saved.update(rss_before=rss_before, rss_after=rss_after, failures=failures, findings=findings, cpu=cpu)
    with open(args.out, "w") as f:
        json.dump(saved, f, indent=2, default=str)
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
