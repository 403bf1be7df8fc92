"""A capacity plan from measured stage costs: replicas per stage, GPUs per node type, vs whole pipelines.

    python benchmarks/capacity.py benchmarks/results.json --rate 20 --ttfa 1.5
    python benchmarks/capacity.py RUN.json --rate 20 --ttfa 1.5 --graph graphs/qwen3_omni.yaml --cluster cluster.yaml

Input: a bench.py JSON (``python benchmarks/bench.py ... --out RUN.json``). Its C=1 row of
``--scenario`` gives each stage's cost per request, ``S_s`` (``stage_s_p50``: seconds from the
stage's first call to its last output in one request, from the replies' ``return_stage_metrics``),
and the unloaded time to first audio ``TTFA_1`` (``ttfa_p50``).

The queueing model (docs/gpus-and-clusters.md, "Capacity plan"): requests arrive as a Poisson
stream at ``--rate`` λ; each stage is an M/M/c queue whose c replicas each serve ``--slots``
requests at a time (1: the transformers engine; a batching engine: its target_ongoing_requests),
each for ``S_s``. A stage with ``n`` slots in all is loaded ``ρ = λ S_s / n`` (< 1 or it never
keeps up) and a request waits on average Erlang C's

    W_s = C(n, λ S_s) · S_s / (n − λ S_s),   C(n, a) = (aⁿ/n! · n/(n−a)) / (Σ_{k<n} aᵏ/k! + aⁿ/n! · n/(n−a))

The predicted TTFA is ``TTFA_1 + Σ_s W_s`` (a request queues once at each stage before its first
audio). The plan starts every stage at the fewest replicas with ρ < 1 and adds one where it shortens
the wait the most until the predicted TTFA meets ``--ttfa``. Whole pipelines (vLLM-Omni's way:
every stage on every GPU set) are the same queues with one shared count P: P copies of every stage.
GPUs: each stage's ``num_gpus`` in ``--graph`` times its replicas, summed per node type (the
cluster.yaml type advertising the stage's marker resource); nodes = GPUs / GPUs per node, rounded
up (fractional stages packed perfectly: a lower bound).

``--check C``: the C-request closed loop of the same run (its row at concurrency C) against the
bound of operational analysis for N = C clients with no think time, X ≤ min(N / R_1, n_b / S_b)
(R_1: the C=1 end-to-end time, b: the stage with the largest S/n), with the run's replicas (``--replicas``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def erlang_wait(slots: int, offered: float, service_s: float) -> float:
    """Mean wait in an M/M/c queue with ``slots`` servers, ``offered`` = λ·S erlangs, service ``service_s``."""
    if offered >= slots:
        return math.inf
    # Erlang B by its recursion (no factorials: stable for hundreds of servers), then Erlang C from it.
    blocked = 1.0
    for k in range(1, slots + 1):
        blocked = offered * blocked / (k + offered * blocked)
    p_wait = blocked / (1 - offered / slots * (1 - blocked))
    return p_wait * service_s / (slots - offered)


def plan_replicas(costs: dict[str, float], rate: float, ttfa_1: float, ttfa: float, slots: int) -> dict[str, int]:
    """Replicas per stage: fewest that keep up, then one more where the wait is longest until TTFA fits."""
    replicas = {s: max(1, math.floor(rate * c / slots) + 1) for s, c in costs.items()}

    def wait(stage: str, n: int) -> float:
        return erlang_wait(n * slots, rate * costs[stage], costs[stage])

    for _ in range(1000):
        if ttfa_1 + sum(wait(s, n) for s, n in replicas.items()) <= ttfa:
            return replicas
        # one more replica where it shortens the wait the most
        replicas[max(replicas, key=lambda s: wait(s, replicas[s]) - wait(s, replicas[s] + 1))] += 1
    raise SystemExit("no plan within 1000 replicas")


def plan_pipelines(costs: dict[str, float], rate: float, ttfa_1: float, ttfa: float, slots: int) -> int:
    """Whole pipelines (every stage once per pipeline): the fewest that keep up and meet the TTFA."""
    for pipelines in range(1, 1000):
        waits = [erlang_wait(pipelines * slots, rate * c, c) for c in costs.values()]
        if ttfa_1 + sum(waits) <= ttfa:
            return pipelines
    raise SystemExit("no plan within 1000 pipelines")


def stage_gpus(graph: dict[str, Any], cluster: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """Stage -> (cluster.yaml node type it is pinned to, num_gpus per replica)."""
    markers = {
        marker: name
        for name, t in cluster["available_node_types"].items()
        for marker in t.get("resources", {})
        if marker not in ("CPU", "GPU")
    }
    out = {}
    for d in graph["applications"][0]["deployments"]:
        options = d.get("ray_actor_options", {})
        pinned = [markers[r] for r in options.get("resources", {}) if r in markers]
        if options.get("num_gpus"):
            out[d["name"]] = (pinned[0] if pinned else "any", float(options["num_gpus"]))
    return out


def row(run: dict[str, Any], scenario: str, concurrency: int) -> dict[str, Any]:
    for r in run["rows"]:
        if r["scenario"] == scenario and r["concurrency"] == concurrency:
            return r
    raise SystemExit(f"no row {scenario!r} at concurrency {concurrency} in the run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a bench.py JSON")
    parser.add_argument("--rate", type=float, required=True, help="target requests per second")
    parser.add_argument("--ttfa", type=float, required=True, help="target mean time to first audio, seconds")
    parser.add_argument("--scenario", default="graph stream-text+audio")
    parser.add_argument("--slots", type=int, default=1, help="requests one replica serves at a time")
    parser.add_argument("--graph", default=str(ROOT / "graphs" / "qwen3_omni.yaml"))
    parser.add_argument("--cluster", default=str(ROOT / "cluster.yaml"))
    parser.add_argument("--check", type=int, default=0, help="compare with the run's row at this concurrency")
    parser.add_argument("--replicas", type=int, default=1, help="replicas per stage in the measured run")
    args = parser.parse_args()

    run = json.loads(Path(args.run).read_text())
    one = row(run, args.scenario, 1)
    costs = {s: c for s, c in one["stage_s_p50"].items() if c}
    ttfa_1 = one["ttfa_p50"]
    print(f"measured at C=1 ({args.scenario}): TTFA {ttfa_1:.3f} s, stage cost per request (s): {costs}")

    replicas = plan_replicas(costs, args.rate, ttfa_1, args.ttfa, args.slots)
    pipelines = plan_pipelines(costs, args.rate, ttfa_1, args.ttfa, args.slots)
    graph = yaml.safe_load(Path(args.graph).read_text())
    cluster = yaml.safe_load(Path(args.cluster).read_text())
    gpus = stage_gpus(graph, cluster)
    node_gpus = {name: t.get("resources", {}).get("GPU", 0) for name, t in cluster["available_node_types"].items()}
    print(f"\nper-stage plan for {args.rate} req/s at TTFA <= {args.ttfa} s ({args.slots} slot(s) per replica):")
    by_type: dict[str, float] = {}
    for stage, n in replicas.items():
        kind, per = gpus.get(stage, ("-", 0.0))
        busy = args.rate * costs[stage] / n
        print(f"  {stage:10s} {n:4d} replicas  ({kind}, {per:g} GPU each, {busy:.2f} of {args.slots} slot(s) busy)")
        by_type[kind] = by_type.get(kind, 0.0) + n * per
    for kind, total in by_type.items():
        nodes = math.ceil(total / node_gpus[kind]) if node_gpus.get(kind) else 0
        print(f"  node type {kind}: {total:g} GPUs -> {nodes} nodes (cluster.yaml max_workers)")
    per_stage_gpus = sum(math.ceil(g / node_gpus[k]) * node_gpus[k] for k, g in by_type.items() if node_gpus.get(k))
    per_pipeline = math.ceil(sum(per for _, per in gpus.values()))
    print(f"  GPUs in all: {per_stage_gpus:g} (whole nodes)")
    print(f"\nwhole pipelines: {pipelines} x {per_pipeline} GPUs = {pipelines * per_pipeline} GPUs")

    if args.check:
        loaded = row(run, args.scenario, args.check)
        bottleneck = max(costs.values()) / (args.replicas * args.slots)  # seconds per request of the slowest stage
        predicted = min(args.check / one["e2e_p50"], 1 / bottleneck)
        print(
            f"\ncheck at C={args.check} ({args.replicas} replica(s) per stage): predicted <= {predicted:.2f} req/s "
            f"(N/R_1 {args.check / one['e2e_p50']:.2f}, 1/S_max {1 / bottleneck:.2f}), "
            f"measured {loaded['req_per_s']:.2f} req/s (ratio {loaded['req_per_s'] / predicted:.2f})"
        )


if __name__ == "__main__":
    main()
