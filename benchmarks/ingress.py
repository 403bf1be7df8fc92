"""The tiny omni graph behind Serve's Python proxy and behind its HAProxy ingress: one run, interleaved rounds.

    python benchmarks/ingress.py                      # 3 rounds; ports 18960 (proxy) and 18970 (HAProxy)
    python benchmarks/ingress.py --rounds 5 --port 19000

Both servers are started the documented way, ``python -m omni_serve.cli.run graphs/tiny_omni.yaml``
(what ``make serve`` runs), each on its own private Ray cluster in a child process: one with
``RAY_SERVE_ENABLE_HA_PROXY=0`` (Serve's Python proxy), one with ``=1`` (HAProxy sends each request
straight to the ingress replica's own HTTP server). Both stay up for the whole run; each round
measures both, in alternating order, with bench.py's client: streamed text + audio at C=1
(end-to-end and time to first audio, p50) and at C=8 (requests per second). It prints per-round
figures, the medians and the ratios HAProxy / proxy, and writes them as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (benchmarks/bench.py: the client and its scenarios)
import vs_native  # noqa: E402  (benchmarks/vs_native.py: a server child process, its readiness, its stop)

INGRESSES = ("proxy", "haproxy")


def ingress_env(ingress: str, port: int) -> dict[str, str]:
    """The server's environment: the ingress switch, and HAProxy's own ports next to the HTTP port."""
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1" if ingress == "haproxy" else "0", "RAY_AUTH_MODE": "disabled"}
    if ingress == "haproxy":
        env |= {
            "RAY_SERVE_HAPROXY_STATS_PORT": str(port + 1),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(port + 2),
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port + 3),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(port + 6),
        }
    return env


@contextlib.contextmanager
def omni_server(ingress: str, port: int, log: Path) -> Iterator[Any]:
    argv = [sys.executable, "-m", "omni_serve.cli.run", str(vs_native.ROOT / "graphs" / "tiny_omni.yaml")]
    argv += ["--port", str(port), "--no-dashboard"]
    saved = dict(os.environ)
    os.environ.update(ingress_env(ingress, port))  # the child (and every Ray process it starts) inherits it
    try:
        with vs_native.server(argv, f"http://127.0.0.1:{port}/health", log) as proc:
            os.environ.clear()
            os.environ.update(saved)
            yield proc
    finally:
        os.environ.clear()
        os.environ.update(saved)


def measure(args: argparse.Namespace, url: str) -> dict[str, float]:
    """One round against one server: C=1 e2e and TTFA p50, C=8 requests per second (errors counted)."""
    client = argparse.Namespace(**{**vars(args), "url": url})
    one = asyncio.run(bench.run_scenario(client, bench.Scenario("c1", True, True, 1))).summary()
    client.requests = args.requests_c8
    eight = asyncio.run(bench.run_scenario(client, bench.Scenario("c8", True, True, 8))).summary()
    return {
        "e2e_c1": one["e2e_p50"],
        "ttfa_c1": one["ttfa_p50"],
        "req_per_s_c8": eight["req_per_s"],
        "ttfa_c8": eight["ttfa_p50"],
        "errors": one["errors"] + eight["errors"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18960, help="the proxy server's; HAProxy's is this + 10")
    parser.add_argument("--requests", type=int, default=8, help="requests at C=1 per round")
    parser.add_argument("--requests-c8", type=int, default=24, help="requests at C=8 per round")
    parser.add_argument("--max-tokens", type=int, default=16, help="thinker tokens per request")
    parser.add_argument("--talker-frames", type=int, default=64, help="codec frames per request (fixed)")
    parser.add_argument("--out", default="benchmarks/ingress.json")
    args = parser.parse_args()
    # bench.py's request settings: fixed talker frames, the tiny graph's model name.
    args.model, args.talker_stage, args.fixed_frames, args.timeout = "tiny-qwen3-omni", "talker", True, 300

    logs = Path(args.out).with_suffix("")
    ports = {"proxy": args.port, "haproxy": args.port + 10}
    rounds: dict[str, list[dict[str, float]]] = {ingress: [] for ingress in INGRESSES}
    with contextlib.ExitStack() as stack:
        for ingress in INGRESSES:
            stack.enter_context(omni_server(ingress, ports[ingress], Path(f"{logs}-{ingress}.log")))
        for r in range(args.rounds):
            order = INGRESSES if r % 2 == 0 else INGRESSES[::-1]
            for ingress in order:
                rounds[ingress].append(measure(args, f"http://127.0.0.1:{ports[ingress]}"))
                print(f"round {r + 1} {ingress:8s} {json.dumps(rounds[ingress][-1])}", flush=True)
    medians = {i: {k: statistics.median(m[k] for m in rounds[i]) for k in rounds[i][0]} for i in INGRESSES}
    ratios = {
        "e2e_c1 (proxy / haproxy: >1 = HAProxy faster)": medians["proxy"]["e2e_c1"] / medians["haproxy"]["e2e_c1"],
        "ttfa_c1 (proxy / haproxy)": medians["proxy"]["ttfa_c1"] / medians["haproxy"]["ttfa_c1"],
        "req_per_s_c8 (haproxy / proxy)": medians["haproxy"]["req_per_s_c8"] / medians["proxy"]["req_per_s_c8"],
    }
    load = os.getloadavg()
    result = {"args": vars(args), "rounds": rounds, "medians": medians, "ratios": ratios, "load_avg_at_end": load}
    Path(args.out).write_text(json.dumps(result, indent=2))
    for ingress in INGRESSES:
        print(f"median {ingress:8s} {json.dumps(medians[ingress])}")
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    print(f"load average at the end (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
