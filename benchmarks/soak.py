"""Soak test: hundreds of mixed requests at fixed concurrency; error counts by kind, process RSS, object store.

    python benchmarks/soak.py                                  # starts the tiny graph on a private Ray cluster
    python benchmarks/soak.py --url http://127.0.0.1:8000      # an omni_serve already running on this machine
    python benchmarks/soak.py --requests 300 --kinds audio audio-stream --handoff-padding-bytes 1048576
                                                               # production-sized (>= 1 MiB) handoffs

Requests rotate through text / text+audio, streaming / not. Every reply is checked in full (a 200
with a missing audio part, or a stream without [DONE], counts as an error). Bounded in count
(--requests) and time (--max-seconds: no new request starts after it). Only 127.0.0.1 is allowed.
Reports errors by kind, latency percentiles per kind, and the start/end RSS of every Ray/Serve
process of the cluster (ingress, each stage replica, proxy, controller). On the cluster it starts,
it also reads the object stores (as ``ray memory --stats-only`` does): idle before, peak during,
right after the last request, and how long until they are back to idle (handoffs must not outlive
their requests). Exit status 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import psutil
import soundfile as sf

# The object-store readings are test code (tests/object_store.py): import them from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.object_store import StoreWatch, object_store_bytes, settled, wait_at_most  # noqa: E402

KINDS = ("text", "text-stream", "audio", "audio-stream")
MESSAGES = ["Say hello.", "What is two plus two?", "Tell me about the sea.", "Name a colour."]


@dataclass
class Outcome:
    kind: str
    seconds: float
    error: str | None = None  # None = complete and well-formed


def request_body(i: int, kind: str, model: str, max_tokens: int, talker_frames: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": MESSAGES[i % len(MESSAGES)]}],
        "max_tokens": max_tokens,
        "seed": i,
        "stream": kind.endswith("stream"),
    }
    if kind.startswith("audio"):
        body.update(
            modalities=["text", "audio"],
            audio={"format": "wav"},
            stage_sampling={"talker": {"max_tokens": talker_frames}},
        )
    return body


def audio_samples(b64: str) -> int:
    data, _ = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")
    return int(np.asarray(data).shape[0])


async def one(client: httpx.AsyncClient, i: int, kind: str, args: argparse.Namespace) -> Outcome:
    body = request_body(i, kind, args.model, args.max_tokens, args.talker_frames)
    started = time.perf_counter()

    def done(error: str | None = None) -> Outcome:
        return Outcome(kind, time.perf_counter() - started, error)

    try:
        if not body["stream"]:
            reply = await client.post("/v1/chat/completions", json=body)
            if reply.status_code != 200:
                return done(f"http {reply.status_code} {_error_type(reply.content)}")
            message = reply.json()["choices"][0]["message"]
            if not isinstance(message.get("content"), str):
                return done("200 without content")
            if kind == "audio" and not audio_samples(message["audio"]["data"]):
                return done("200 with empty audio")
            return done()
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                return done(f"http {reply.status_code} {_error_type(await reply.aread())}")
            events = [line[6:] async for line in reply.aiter_lines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            last = json.loads(events[-1]) if events else {}
            return done(f"stream error {last.get('error', {}).get('type', 'without [DONE]')}")
        chunks = [json.loads(e) for e in events[:-1]]
        if not any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks):
            return done("stream without finish_reason")
        audio = [c for c in chunks if c.get("modality") == "audio"]
        if kind == "audio-stream" and not audio:
            return done("stream without audio")
        return done()
    except httpx.TimeoutException:
        return done("client timeout")
    except httpx.HTTPError as err:
        return done(f"transport {type(err).__name__}")
    except (ValueError, KeyError, IndexError, TypeError) as err:
        return done(f"malformed reply {type(err).__name__}")


def _error_type(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "(not an OpenAI error)"


async def soak(args: argparse.Namespace) -> tuple[list[Outcome], float]:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + args.max_seconds
    next_index = 0
    started = time.perf_counter()

    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout, limits=limits) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < args.requests and time.monotonic() < deadline:
                i, next_index = next_index, next_index + 1
                outcomes.append(await one(client, i, args.kinds[i % len(args.kinds)], args))
                if len(outcomes) % 50 == 0:
                    print(f"  {len(outcomes)} done, {sum(o.error is not None for o in outcomes)} errors", flush=True)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return outcomes, time.perf_counter() - started


# ---- processes ---------------------------------------------------------------------------------


def ray_processes(root_pid: int | None) -> dict[str, int]:
    """label -> pid for the Serve controller, proxies and replicas (descendants of ``root_pid`` if given)."""
    if root_pid is not None:
        root = psutil.Process(root_pid)
        candidates = [root, *root.children(recursive=True)]
    else:
        candidates = list(psutil.process_iter())
    found: dict[str, int] = {}
    for proc in candidates:
        try:
            title = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if not title.startswith("ray::"):
            continue
        actor = title.split()[0].removeprefix("ray::").split(".")[0]
        if actor.startswith("ServeReplica:"):
            label = actor.rsplit(":", 1)[-1]  # the deployment: ingress / thinker / talker / code2wav
        elif actor in ("ServeController", "ProxyActor"):
            label = {"ServeController": "controller", "ProxyActor": "proxy"}[actor]
        else:
            continue
        found[f"{label}#{proc.pid}"] = proc.pid
    return found


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for label, pid in pids.items():
        try:
            out[label] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


# ---- object store ------------------------------------------------------------------------------

BACK_TO_IDLE_S = 10
IDLE_TOLERANCE = 256 << 10  # less than one padded handoff: Serve's own small objects come and go


def object_store_report(gcs: str, idle: int, peak: int) -> dict[str, Any]:
    """Idle / peak / end MiB of the object stores, and the seconds until back to idle (at most BACK_TO_IDLE_S)."""
    end = object_store_bytes(gcs)
    after, waited = wait_at_most(lambda: object_store_bytes(gcs), idle + IDLE_TOLERANCE, BACK_TO_IDLE_S)
    mib: dict[str, Any] = {
        "idle_mib": idle / 2**20,
        "peak_mib": peak / 2**20,
        "end_mib": end / 2**20,
        "after_mib": after / 2**20,
    }
    back = after <= idle + IDLE_TOLERANCE
    print(
        f"\nobject store: idle {mib['idle_mib']:.1f} MiB, peak {mib['peak_mib']:.1f} MiB, "
        f"right after the last request {mib['end_mib']:.1f} MiB, "
        + (f"back to idle {waited:.1f} s later" if back else f"{mib['after_mib']:.1f} MiB {BACK_TO_IDLE_S} s later")
    )
    return {**mib, "back_to_idle": back, "back_to_idle_s": waited}


# ---- report ------------------------------------------------------------------------------------


def report(outcomes: list[Outcome], wall_s: float, rss_start: dict[str, float], rss_end: dict[str, float]) -> dict:
    errors = Counter(o.error for o in outcomes if o.error)
    per_kind: dict[str, list[float]] = defaultdict(list)
    for o in outcomes:
        if o.error is None:
            per_kind[o.kind].append(o.seconds)
    print(f"\n{len(outcomes)} requests in {wall_s:.0f} s ({len(outcomes) / wall_s:.2f} req/s)")
    print("| kind | ok | p50 s | p95 s |\n|---|---|---|---|")
    for kind in KINDS:
        done = per_kind.get(kind, [])
        if done:
            p50, p95 = np.percentile(done, [50, 95])
            print(f"| {kind} | {len(done)} | {p50:.2f} | {p95:.2f} |")
    print(f"\nerrors: {sum(errors.values())}" + "".join(f"\n  {n} x {kind}" for kind, n in errors.most_common()))
    print("\n| process | RSS start MiB | RSS end MiB | delta |\n|---|---|---|---|")
    for label in sorted(set(rss_start) | set(rss_end), key=lambda s: (s.split("#")[0], int(s.split("#")[1]))):
        a, b = rss_start.get(label), rss_end.get(label)
        delta = f"{b - a:+.0f}" if a is not None and b is not None else "-"
        print(f"| {label} | {a or 0:.0f} | {b or 0:.0f} | {delta} |".replace("| 0 |", "| - |"))
    return {
        "requests": len(outcomes),
        "wall_s": wall_s,
        "errors": dict(errors),
        "ok_by_kind": {k: len(v) for k, v in per_kind.items()},
        "rss_start_mib": rss_start,
        "rss_end_mib": rss_end,
    }


# ---- main --------------------------------------------------------------------------------------


def start_private_graph(graph: str, port: int, padding: int) -> tuple[str, int, str, Callable[[], None]]:
    """A private Ray cluster (never an existing one) with ``graph`` deployed via `serve run`.

    ``padding`` > 0 pads every handoff of the transformers stages by that many bytes (test-only engine arg).
    Returns the URL, the raylet's pid, the GCS address and a function that stops it all.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from omni_serve.cli.launch import deploy_graph_file, pad_handoffs, wait_healthy

    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="serve", log_to_driver=False)

    def stop() -> None:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    try:
        gcs = ray.get_runtime_context().gcs_address
        deploy_graph_file(graph, gcs, port, (lambda config: pad_handoffs(config, padding)) if padding else None)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    except BaseException:
        stop()
        raise
    return url, raylet, gcs, stop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="target a running omni_serve (127.0.0.1 only) instead of starting one")
    parser.add_argument("--graph", default="tiny_omni.yaml", help="graph file to start (without --url)")
    parser.add_argument("--port", type=int, default=18990, help="HTTP port of the started graph")
    parser.add_argument("--model", default="tiny-qwen3-omni")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-seconds", type=float, default=540, help="no new request starts after this")
    parser.add_argument("--request-timeout", type=float, default=150)
    parser.add_argument("--max-tokens", type=int, default=8, help="thinker tokens per request")
    parser.add_argument("--talker-frames", type=int, default=12, help="codec frames per audio request")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="request kinds, in rotation")
    parser.add_argument(
        "--handoff-padding-bytes", type=int, default=0, help="pad every handoff by this much (started graph only)"
    )
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()

    stop: Callable[[], None] = lambda: None  # noqa: E731
    raylet: int | None = None
    gcs: str | None = None
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost"):
            parser.error("--url must point at 127.0.0.1: this tool only loads the local machine")
    else:
        print(f"starting {args.graph} on a private Ray cluster ...", flush=True)
        args.url, raylet, gcs, stop = start_private_graph(args.graph, args.port, args.handoff_padding_bytes)
    try:
        processes = ray_processes(raylet)
        rss_start = rss_mib(processes)
        idle = settled(lambda: object_store_bytes(gcs)) if gcs else None
        print(f"soak: {args.requests} requests, concurrency {args.concurrency}, {args.url}", flush=True)
        with StoreWatch(gcs, period_s=0.1) if gcs else contextlib.nullcontext() as watch:
            outcomes, wall_s = asyncio.run(soak(args))
        store = object_store_report(gcs, idle, watch.peak) if gcs and idle is not None else None
        rss_end = rss_mib({**processes, **ray_processes(raylet)})  # replicas started meanwhile too
        summary = report(outcomes, wall_s, rss_start, rss_end)
        if store:
            summary["object_store"] = store
    finally:
        stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    leaked = "object_store" in summary and not summary["object_store"]["back_to_idle"]
    return 1 if summary["errors"] or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
