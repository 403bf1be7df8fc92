"""Per-stage autoscaling of the tiny omni graph on CPU: which stages scale under which load.

    python benchmarks/autoscale.py                    # ~4 min on a 2-core machine

Starts graphs/tiny_omni.yaml on a private Ray cluster (the real `serve run` CLI, via
omni_serve.cli.launch) with short autoscaling delays for the demo, then runs phases:

    idle -> text+audio load -> idle (scale down) -> text-only load -> idle (scale down)

and polls `serve.status()` every second for each stage's replica counts. Under the
text+audio load the talker and code2wav scale up (code2wav also held at >= 1 per 2 talkers
by the graph's `min_ratios`); under the text-only load only the thinker does. Writes the
timeline to JSON and prints a compact table (one row per change of replica counts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

STAGES = ("thinker", "talker", "code2wav")
MESSAGES = [{"role": "user", "content": "Tell me a short story about a robot."}]


@dataclass
class Timeline:
    """Replica counts per stage over time, polled from serve.status()."""

    start: float = field(default_factory=time.monotonic)
    start_wall: float = field(default_factory=time.time)
    phase: str = "deploy"
    rows: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def poll(self, app: str, interval_s: float) -> None:
        from ray import serve

        while not self.stop.is_set():
            try:
                deployments = serve.status().applications[app].deployments
                row: dict[str, Any] = {"t": round(time.monotonic() - self.start, 1), "phase": self.phase}
                for name in STAGES:
                    states = {
                        str(k.value if hasattr(k, "value") else k): v
                        for k, v in deployments[name].replica_states.items()
                    }
                    row[name] = states.get("RUNNING", 0)
                    row[f"{name}_starting"] = states.get("STARTING", 0)
                self.rows.append(row)
            except Exception as err:  # the cluster is going away, or status raced a redeploy
                self.rows.append(
                    {"t": round(time.monotonic() - self.start, 1), "phase": self.phase, "error": repr(err)}
                )
            self.stop.wait(interval_s)

    def peak(self, phase: str) -> dict[str, int]:
        rows = [r for r in self.rows if r["phase"] == phase and "error" not in r]
        return {s: max((r[s] for r in rows), default=0) for s in STAGES}

    def last(self, phase: str) -> dict[str, int]:
        rows = [r for r in self.rows if r["phase"] == phase and "error" not in r]
        return {s: rows[-1][s] for s in STAGES} if rows else {}

    def changes(self) -> list[dict[str, Any]]:
        """Rows where the phase or any replica count changed (the compact timeline)."""
        out: list[dict[str, Any]] = []
        key = None
        for r in self.rows:
            if "error" in r:
                continue
            k = (r["phase"], *(r[s] for s in STAGES), *(r[f"{s}_starting"] for s in STAGES))
            if k != key:
                out.append(r)
                key = k
        return out


def body(audio: bool, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "tiny-qwen3-omni", "messages": MESSAGES, "max_tokens": args.max_tokens, "seed": seed}
    if audio:
        b.update(
            modalities=["text", "audio"],
            audio={"format": "wav"},
            stage_sampling={"talker": {"max_tokens": args.talker_frames}},
        )
    return b


async def load(url: str, audio: bool, concurrency: int, duration_s: float, args: argparse.Namespace) -> dict[str, Any]:
    """Closed-loop load: ``concurrency`` clients, each sending the next request when one returns."""
    done, errors, latencies = 0, 0, []
    deadline = time.monotonic() + duration_s
    first_error: str | None = None

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal done, errors, first_error
        seed = i * 100_000
        while time.monotonic() < deadline:
            seed += 1
            t0 = time.perf_counter()
            try:
                r = await http.post("/v1/chat/completions", json=body(audio, args, seed))
                r.raise_for_status()
                done += 1
                latencies.append(time.perf_counter() - t0)
            except Exception as err:  # counted; the timeline matters here, not each reply
                errors += 1
                first_error = first_error or f"{type(err).__name__}: {err}"

    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as http:
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
    latencies.sort()
    return {
        "requests": done,
        "errors": errors,
        "first_error": first_error,
        "req_per_s": done / duration_s,
        "e2e_p50": latencies[len(latencies) // 2] if latencies else None,
    }


def demo_autoscaling(args: argparse.Namespace):
    """The `mutate` for deploy_graph_file: short delays and windows so the demo takes minutes, not hours."""

    def mutate(config: dict[str, Any]) -> None:
        app = config["applications"][0]
        for d in app["deployments"]:
            auto = d.get("autoscaling_config")
            if auto is None:
                continue
            auto.update(
                upscale_delay_s=args.upscale_delay_s,
                downscale_delay_s=args.downscale_delay_s,
                look_back_period_s=args.look_back_period_s,
                metrics_interval_s=1.0,
            )
            if args.max_replicas:
                auto["max_replicas"] = args.max_replicas

    return mutate


def policy_log(start_wall: float) -> list[dict[str, Any]]:
    """The policy's own log lines from this cluster's Serve controller: every change of a stage's wish, and why."""
    import glob

    import ray

    try:  # the session directory has no public accessor; this is a benchmark, not the product
        session = ray._private.worker._global_node.get_session_dir_path()
    except AttributeError:
        return []
    out: list[dict[str, Any]] = []
    for path in sorted(glob.glob(os.path.join(session, "logs", "serve", "controller_*.log"))):
        with open(path, errors="replace") as f:
            for line in f:
                if "omni_serve autoscaling:" not in line:
                    continue
                # "INFO 2026-11-21 12:53:32,056 controller 24179 -- omni_serve autoscaling: ..."
                stamp = datetime.strptime(" ".join(line.split()[1:3]), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                message = line.split(" -- ", 1)[-1].strip().removeprefix("omni_serve autoscaling: ")
                out.append({"t": round(stamp - start_wall, 1), "decision": message})
    return sorted(out, key=lambda d: d["t"])


def table(rows: list[dict[str, Any]]) -> str:
    head = "| t (s) | phase | " + " | ".join(STAGES) + " |"
    lines = [head, "|---|---|" + "---|" * len(STAGES)]
    for r in rows:
        cells = [f"{r[s]}" + (f" (+{r[f'{s}_starting']})" if r[f"{s}_starting"] else "") for s in STAGES]
        lines.append(f"| {r['t']:.0f} | {r['phase']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=int(os.environ.get("OMNI_SERVE_TEST_PORT", "18800")))
    parser.add_argument("--graph", default="tiny_omni.yaml")
    parser.add_argument("--audio-concurrency", type=int, default=8)
    parser.add_argument("--text-concurrency", type=int, default=8)
    parser.add_argument("--load-s", type=float, default=45, help="seconds of each load phase")
    parser.add_argument("--idle-s", type=float, default=35, help="seconds of each idle phase after a load")
    parser.add_argument("--upscale-delay-s", type=float, default=5)
    parser.add_argument("--downscale-delay-s", type=float, default=10)
    parser.add_argument("--look-back-period-s", type=float, default=10)
    parser.add_argument(
        "--max-replicas", type=int, default=3, help="every stage's max_replicas for the demo (0: the graph's)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="thinker tokens per request")
    parser.add_argument("--talker-frames", type=int, default=64, help="codec frames per audio request")
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the private Ray cluster")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--out", default="benchmarks/results_autoscale.json")
    args = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from omni_serve.cli.launch import deploy_graph_file, wait_healthy

    url = f"http://127.0.0.1:{args.port}"
    timeline = Timeline()
    phases: list[dict[str, Any]] = []
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, namespace="serve", log_to_driver=False)
    poller = threading.Thread(target=timeline.poll, args=("omni", 1.0), daemon=True)
    try:
        config = deploy_graph_file(args.graph, ray.get_runtime_context().gcs_address, args.port, demo_autoscaling(args))
        wait_healthy(url)
        poller.start()
        plan = [
            ("idle", None, 0, 5.0),
            ("text+audio", True, args.audio_concurrency, args.load_s),
            ("idle after audio", None, 0, args.idle_s),
            ("text", False, args.text_concurrency, args.load_s),
            ("idle after text", None, 0, args.idle_s),
        ]
        for name, audio, concurrency, seconds in plan:
            timeline.phase = name
            t0 = time.monotonic() - timeline.start
            if audio is None:
                time.sleep(seconds)
                stats: dict[str, Any] = {}
            else:
                stats = asyncio.run(load(url, audio, concurrency, seconds, args))
            phases.append(
                {
                    "phase": name,
                    "start_s": round(t0, 1),
                    "seconds": seconds,
                    "concurrency": concurrency if audio is not None else 0,
                    **stats,
                    "peak_replicas": timeline.peak(name),
                    "end_replicas": timeline.last(name),
                }
            )
            print(f"{name}: {stats or ''} peak={timeline.peak(name)} end={timeline.last(name)}", flush=True)
    finally:
        timeline.stop.set()
        if poller.is_alive():
            poller.join(timeout=5)
        decisions = policy_log(timeline.start_wall)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    app = config["applications"][0]
    result = {
        "args": vars(args),
        "machine": f"{os.cpu_count()} CPUs",
        "autoscaling_policy": app.get("autoscaling_policy"),
        "autoscaling_config": {d["name"]: d.get("autoscaling_config") for d in app["deployments"]},
        "max_ongoing_requests": {d["name"]: d.get("max_ongoing_requests") for d in app["deployments"]},
        "phases": phases,
        "policy_decisions": decisions,
        "timeline": timeline.rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(table(timeline.changes()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
