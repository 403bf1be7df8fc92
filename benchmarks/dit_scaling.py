"""Per-stage scaling of an AR -> DiT image model: GLM-Image's stages scale apart, measured with step pacing.

    python benchmarks/dit_scaling.py            # ~8 min on a 2-core machine

Serves graphs/tiny_glm_image_vllm_omni.yaml (the tiny GLM-Image: its AR stage on vLLM's EngineCore, its DiT on
vLLM-Omni's DiffusionEngine) on a private Ray cluster, both stages paced as a GPU would run them
(``min_step_s``, omni_serve.pacing: each engine step waits out the stated time, so the two shared cores do not
decide): the AR at ``--ar-step-s`` per decoding step for its whole batch (513 steps a request here), the DiT at
``--dit-step-s`` per denoising step (2 a request), the slower stage. Then, in one run, the same closed loop of
``--concurrency`` clients sending ``--requests`` image requests each phase:

1. **one DiT replica** (and one AR replica);
2. **autoscaling** from one replica each (both may grow to two; short delays for the demo): the policy
   (omni_serve.graph.autoscaling) reads each stage's own queue, so the DiT, where requests wait, gets its
   second replica and the AR, which keeps up, does not;
3. **two DiT replicas** (the AR still one): the DiT's replica count changed in place, nothing else.

Prints and writes (``--out``) each phase's throughput, the ratio of phase 3 to phase 1, and the replica counts
phase 2 reached. Every reply is a 64x64 PNG, checked by decoding it with Pillow.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import threading
import time
from typing import Any

import httpx

GRAPH = "tiny_glm_image_vllm_omni.yaml"
STAGES = ("ar", "dit")


def paced(args: argparse.Namespace, dit_replicas: int, autoscale: bool = False) -> Any:
    """The ``mutate`` for deploy_graph_file: both stages paced; the replicas of each phase."""

    def mutate(config: dict[str, Any]) -> None:
        app = config["applications"][0]
        for stage in app["args"]["stages"]:
            stage["engine_args"]["min_step_s"] = args.ar_step_s if stage["name"] == "ar" else args.dit_step_s
        for d in app["deployments"]:
            if d["name"] not in STAGES:
                continue
            count = dit_replicas if d["name"] == "dit" else 1
            auto = d["autoscaling_config"]
            auto.update(min_replicas=count, initial_replicas=count, max_replicas=count)
            if autoscale:
                auto.update(
                    min_replicas=1,
                    initial_replicas=1,
                    max_replicas=2,
                    upscale_delay_s=args.upscale_delay_s,
                    downscale_delay_s=600,
                    look_back_period_s=5,
                    metrics_interval_s=1.0,
                )
            d["max_ongoing_requests"] = max(d["max_ongoing_requests"], args.concurrency)

    return mutate


def replicas() -> dict[str, int]:
    """Running replicas per stage (Serve's status)."""
    from ray import serve

    deployments = serve.status().applications["omni"].deployments
    return {name: deployments[name].replica_states.get("RUNNING", 0) for name in STAGES if name in deployments}


async def closed_loop(url: str, concurrency: int, requests: int, timeout_s: float) -> dict[str, Any]:
    """``concurrency`` clients, each sending its next request when its last answered, ``requests`` in all."""
    from PIL import Image

    left = list(range(requests))
    latencies: list[float] = []

    async def client(http: httpx.AsyncClient) -> None:
        while left:
            seed = left.pop()
            body = {"prompt": "a red fox", "size": "64x64", "seed": seed}
            started = time.perf_counter()
            reply = await http.post(f"{url}/v1/images/generations", json=body)
            assert reply.status_code == 200, reply.text[:300]
            png = base64.b64decode(reply.json()["data"][0]["b64_json"])
            with Image.open(io.BytesIO(png)) as image:
                assert image.format == "PNG" and image.size == (64, 64)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    latencies.sort()
    return {
        "requests": requests,
        "seconds": round(seconds, 1),
        "images_per_s": round(requests / seconds, 4),
        "latency_p50_s": round(latencies[len(latencies) // 2], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=int(os.environ.get("OMNI_SERVE_TEST_PORT", "18800")))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24, help="requests per phase")
    parser.add_argument("--ar-step-s", type=float, default=0.01, help="the AR's paced decoding step (whole batch)")
    parser.add_argument("--dit-step-s", type=float, default=4.0, help="the DiT's paced denoising step")
    parser.add_argument("--upscale-delay-s", type=float, default=3.0, help="phase 3's upscale delay")
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the private Ray cluster")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default="benchmarks/results_dit_scaling.json")
    args = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from omni_serve.cli.launch import deploy_graph_file, wait_healthy

    url = f"http://127.0.0.1:{args.port}"
    phases: list[dict[str, Any]] = []
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, namespace="serve", log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        # Autoscaling before the two replicas: from two, Serve would keep the second for the downscale delay.
        plan = [("one DiT replica", 1, False), ("autoscaling", 1, True), ("two DiT replicas", 2, False)]
        for i, (name, dit, autoscale) in enumerate(plan):
            deploy_graph_file(GRAPH, address, args.port, paced(args, dit, autoscale))
            wait_healthy(url, timeout_s=900, replaced=i > 0)
            deadline = time.monotonic() + 900
            while replicas() != {"ar": 1, "dit": dit}:  # the replica count Serve changes in place
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: replicas {replicas()} after 900 s")
                time.sleep(1)
            peak = dict(replicas())
            done = threading.Event()

            def watch(peak: dict[str, int] = peak, done: threading.Event = done) -> None:
                while not done.wait(1.0):
                    for stage, count in replicas().items():
                        peak[stage] = max(peak[stage], count)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            try:
                result = asyncio.run(closed_loop(url, args.concurrency, args.requests, args.timeout))
            finally:
                done.set()
                watcher.join()
            phases.append({"phase": name, "dit_replicas": dit, "peak_replicas": peak, **result})
            print(f"{name}: {result} peak replicas {peak}", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    one, scaled, two = phases
    ratio = two["images_per_s"] / one["images_per_s"]
    result = {
        "args": vars(args),
        "machine": f"{os.cpu_count()} CPUs",
        "phases": phases,
        "two_over_one_dit_replica": round(ratio, 3),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"throughput, two DiT replicas / one: {ratio:.2f}x; autoscaling reached {scaled['peak_replicas']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
