"""Latency/throughput of an omni_serve graph over HTTP, with the in-process HF baseline in the same run.

    python benchmarks/bench.py --start-tiny                    # starts the tiny CPU graph itself
    python benchmarks/bench.py --url http://127.0.0.1:8000     # any running omni_serve
    python benchmarks/bench.py --gpu [--dry-run]               # the vLLM-Omni graph on one GPU (see below)

``--gpu`` starts ``graphs/tiny_omni_vllm.yaml`` packed onto one CUDA GPU (``tests/one_gpu.py``: bfloat16,
GPU shares thinker 0.3 / talker 0.3 / code2wav 0.2, vLLM-Omni stage engines) on a private Ray cluster and
measures streamed text + audio at C=1 and C=8 (no HF baseline); ``--dry-run`` prints what it would deploy
and run, starting nothing. ``benchmarks/vs_vllm_omni.py --gpu`` puts native vLLM-Omni beside it.

Scenario ``image+audio-in`` sends the text scenario's prompt with a 640x480 JPEG (``image_url`` data
URL) and 5 s of 16 kHz WAV (``input_audio``) in the same message: compare it with ``text`` at the
same concurrency for what media input costs (entry-stage decoding, processor, encoders, longer prompt).

Per request it records TTFT (first text delta), TTFA (first audio chunk), end-to-end latency and
RTF (e2e / seconds of audio). Non-streamed requests have TTFT = TTFA = e2e. The baseline is HF
transformers' in-process `generate(return_audio=True)` on the same tiny checkpoint, run
sequentially with the same thinker/talker budgets. Writes JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf

PROMPT = "Tell me a short story about a robot."
MESSAGES = [{"role": "user", "content": PROMPT}]


def media_messages() -> list[dict[str, Any]]:
    """The same prompt with a 640x480 JPEG and 5 s of speech-band audio (a WAV) in the message."""
    from PIL import Image

    y, x = np.mgrid[0:480, 0:640]
    rng = np.random.default_rng(0)
    pixels = np.stack([x * 255 // 639, y * 255 // 479, (x + y) % 256], -1) + rng.integers(0, 24, (480, 640, 3))
    image = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(image, format="JPEG", quality=85)
    t = np.arange(5 * 16000) / 16000
    audio = io.BytesIO()
    sf.write(audio, (0.3 * np.sin(2 * np.pi * 220 * t * (1 + t / 5))).astype(np.float32), 16000, format="WAV")
    jpeg, wav = (base64.b64encode(b.getvalue()).decode() for b in (image, audio))
    parts = [
        {"type": "text", "text": PROMPT},
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{jpeg}"}},
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
    ]
    return [{"role": "user", "content": parts}]


@dataclass
class Sample:
    ttft: float | None = None
    ttfa: float | None = None
    e2e: float = 0.0
    audio_s: float = 0.0
    prompt_tokens: int | None = None  # as the server counts them (non-streamed requests)
    stage_s: dict[str, float] = field(default_factory=dict)  # each stage's first call to last output
    error: str | None = None


@dataclass
class Scenario:
    name: str
    stream: bool
    audio: bool
    concurrency: int
    messages: list[dict[str, Any]] = field(default_factory=lambda: MESSAGES)
    reply_tokens: int | None = None  # the handoff sweep's thinker reply length (None: --max-tokens)
    # omni_serve's own request fields (stage_sampling, return_stage_metrics); False: OpenAI's only, for a
    # server that is not omni_serve (native vLLM-Omni in benchmarks/vs_vllm_omni.py --gpu), which then
    # runs every stage with its own defaults.
    omni_fields: bool = True
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.error is None]

        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) if values else None

        e2e = [s.e2e for s in ok]
        ttft = [s.ttft for s in ok if s.ttft is not None]
        ttfa = [s.ttfa for s in ok if s.ttfa is not None]
        rtf = [s.e2e / s.audio_s for s in ok if s.audio_s > 0]
        return {
            "scenario": self.name,
            "requests": len(self.samples),
            "errors": len(self.samples) - len(ok),
            "concurrency": self.concurrency,
            "ttft_p50": pct(ttft, 50),
            "ttfa_p50": pct(ttfa, 50),
            "ttfa_p99": pct(ttfa, 99),
            "e2e_p50": pct(e2e, 50),
            "e2e_p90": pct(e2e, 90),
            "e2e_p99": pct(e2e, 99),
            "rtf_p50": pct(rtf, 50),
            "audio_s_p50": pct([s.audio_s for s in ok], 50),
            "prompt_tokens_p50": pct([s.prompt_tokens for s in ok if s.prompt_tokens is not None], 50),
            "req_per_s": len(ok) / self.wall_s if self.wall_s else None,
            # Per stage, seconds from its first call to its last output in one request (the reply's
            # return_stage_metrics, stage_gen_time_ms): benchmarks/capacity.py's stage costs.
            "stage_s_p50": {
                stage: pct([s.stage_s[stage] for s in ok if stage in s.stage_s], 50)
                for stage in sorted({stage for s in ok for stage in s.stage_s})
            },
        }


def _audio_seconds(b64: str) -> float:
    data, rate = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")
    return len(data) / rate


def _stage_seconds(metrics: dict[str, Any] | None) -> dict[str, float]:
    """Stage name -> seconds, from a reply's or chunk's ``metrics`` (return_stage_metrics)."""
    stages = (metrics or {}).get("stage_metrics", {})
    return {m["stage_name"]: m["stage_gen_time_ms"] / 1000 for m in stages.values()}


def _body(args: argparse.Namespace, sc: Scenario, seed: int) -> dict[str, Any]:
    audio, stream = sc.audio, sc.stream
    body: dict[str, Any] = {
        "model": args.model,
        "messages": sc.messages,
        "max_tokens": sc.reply_tokens or args.max_tokens,
        "seed": seed,
        "stream": stream,
    }
    if sc.omni_fields:
        stage_sampling: dict[str, Any] = {args.talker_stage: _talker_sampling(args)} if audio else {}
        if sc.reply_tokens:  # the handoff sweep: every reply has exactly this many thinker tokens
            stage_sampling["thinker"] = {"ignore_eos": True}
        body.update(stage_sampling=stage_sampling or None, return_stage_metrics=True)
    if audio:
        body.update(modalities=["text", "audio"], audio={"format": "wav"})
    return {k: v for k, v in body.items() if v is not None}


def _talker_sampling(args: argparse.Namespace) -> dict[str, Any]:
    # --fixed-frames: the talker ignores its codec EOS, so every request (and the baseline) makes exactly
    # --talker-frames frames of audio: the graph and the baseline do the same work.
    return {"max_tokens": args.talker_frames, **({"ignore_eos": True} if args.fixed_frames else {})}


async def _one(client: httpx.AsyncClient, args: argparse.Namespace, sc: Scenario, seed: int) -> Sample:
    sample = Sample()
    start = time.perf_counter()
    try:
        body = _body(args, sc, seed)
        if not sc.stream:
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            sample.e2e = sample.ttft = sample.ttfa = time.perf_counter() - start
            reply = response.json()
            sample.prompt_tokens = reply["usage"]["prompt_tokens"]
            sample.stage_s = _stage_seconds(reply.get("metrics"))
            audio = reply["choices"][0]["message"].get("audio")
            sample.audio_s = _audio_seconds(audio["data"]) if audio else 0.0
            if not sc.audio:
                sample.ttfa = None
            return sample
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                sample.stage_s |= _stage_seconds(chunk.get("metrics"))
                delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                now = time.perf_counter() - start
                # An audio chunk: omni_serve's in delta.audio.data, native vLLM-Omni's in delta.content,
                # both marked by vLLM-Omni's chunk-level "modality" (as vLLM-Omni's own benchmark client reads them).
                is_audio = chunk.get("modality") == "audio" or bool(delta.get("audio"))
                if delta.get("content") and not is_audio and sample.ttft is None:
                    sample.ttft = now
                audio_data = (delta.get("audio") or {}).get("data") or (delta.get("content") if is_audio else None)
                if audio_data:
                    sample.ttfa = sample.ttfa if sample.ttfa is not None else now
                    sample.audio_s += _audio_seconds(audio_data)
        sample.e2e = time.perf_counter() - start
    except Exception as err:  # recorded, counted as an error in the table
        sample.error = f"{type(err).__name__}: {err}"
    return sample


async def run_scenario(args: argparse.Namespace, sc: Scenario) -> Scenario:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout) as client:
        await _one(client, args, sc, seed=10_000)  # warm-up, not counted

        async def worker() -> None:
            while not queue.empty():
                sc.samples.append(await _one(client, args, sc, seed=queue.get_nowait()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(sc.concurrency)))
        sc.wall_s = time.perf_counter() - start
    return sc


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """HF in-process generate(return_audio=True) on the same tiny checkpoint, sequentially."""
    import torch

    from omni_serve.checkpoints.tiny_omni import ensure_tiny_omni
    from omni_serve.models.qwen3_omni import SAMPLE_RATE

    # The reference is test code (tests/hf_reference.py): import it from this checkout.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.hf_reference import hf_reference_generate

    torch.set_num_threads(args.baseline_threads)
    path = ensure_tiny_omni()
    # Same budgets and the graph's talker sampling (the tiny graph's thinker uses top_k 1: greedy).
    kwargs = dict(
        max_new_tokens=args.max_tokens,
        max_frames=args.talker_frames,
        talker_temperature=0.9,
        talker_ignore_eos=args.fixed_frames,
    )
    hf_reference_generate(path, MESSAGES, seed=10_000, **kwargs)  # warm-up
    e2e, audio_s = [], []
    start = time.perf_counter()
    for i in range(args.requests):
        t0 = time.perf_counter()
        _, wav = hf_reference_generate(path, MESSAGES, seed=i, **kwargs)
        e2e.append(time.perf_counter() - t0)
        audio_s.append(len(wav) / SAMPLE_RATE)
    wall = time.perf_counter() - start
    return {
        "scenario": "baseline: HF generate in-process (sequential)",
        "requests": args.requests,
        "errors": 0,
        "concurrency": 1,
        "e2e_p50": statistics.median(e2e),
        "e2e_p90": float(np.percentile(e2e, 90)),
        "e2e_p99": float(np.percentile(e2e, 99)),
        "rtf_p50": statistics.median([e / a for e, a in zip(e2e, audio_s, strict=True) if a > 0] or [0.0]),
        "audio_s_p50": statistics.median(audio_s),
        "req_per_s": args.requests / wall,
    }


def table(rows: list[dict[str, Any]], cols: list[str] | None = None) -> str:
    cols = cols or [
        "scenario",
        "requests",
        "errors",
        "concurrency",
        "ttft_p50",
        "ttfa_p50",
        "ttfa_p99",
        "e2e_p50",
        "e2e_p90",
        "e2e_p99",
        "rtf_p50",
        "audio_s_p50",
        "prompt_tokens_p50",
        "req_per_s",
    ]

    def fmt(v: Any) -> str:
        return "–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _fixed(replicas: dict[str, int]) -> Any:
    """Config edit: fixed replica counts instead of autoscaling, so scenarios measure a steady graph."""

    def mutate(config: dict[str, Any]) -> None:
        app = config["applications"][0]
        if replicas:
            app.pop("autoscaling_policy", None)
        for deployment in app["deployments"]:
            if deployment["name"] in replicas:
                deployment.pop("autoscaling_config", None)
                deployment["num_replicas"] = replicas[deployment["name"]]

    return mutate


def _graph_edit(replicas: dict[str, int], streamed: bool | None = None, pace: dict[str, float] | None = None) -> Any:
    """Config edit: fixed replicas, the talker's ``stream_input`` and each stage's ``min_step_s`` (the sweep)."""
    fixed = _fixed(replicas)

    def mutate(config: dict[str, Any]) -> None:
        fixed(config)
        for stage in config["applications"][0]["args"]["stages"]:
            if streamed is not None and stage["name"] == "talker":
                stage["stream_input"] = streamed
            if pace and stage["name"] in pace:
                stage.setdefault("engine_args", {})["min_step_s"] = pace[stage["name"]]

    return mutate


def _replica_counts(text: str) -> dict[str, int]:
    return {name: int(count) for name, count in (item.split("=") for item in text.split(",") if item)}


def parse_paces(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in (item.split("=") for item in text.split(",") if item)}


# The accelerator model of --handoff-sweep (seconds per engine step, waited, not computed; README says
# where the figures come from): thinker per token, talker per codec frame, code2wav per chunk decode.
H100_PACE = {"thinker": 0.015, "talker": 0.012, "code2wav": 0.02}


# name -> (streamed, audio out, image and audio in)
SCENARIOS = {
    "text": (False, False, False),
    "text+audio": (False, True, False),
    "stream-text+audio": (True, True, False),
    "image+audio-in": (False, False, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--start-tiny", action="store_true", help="start --graph (graphs/tiny_omni.yaml) on a private Ray cluster"
    )
    parser.add_argument("--model", default="tiny-qwen3-omni")
    parser.add_argument("--graph", default="tiny_omni.yaml", help="graph --start-tiny / --handoff-sweep deploy")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--max-tokens", type=int, default=16, help="thinker tokens per request")
    parser.add_argument("--talker-frames", type=int, default=64, help="codec frames per request (12.5 per second)")
    parser.add_argument("--talker-stage", default="talker")
    parser.add_argument(
        "--fixed-frames",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every request and the baseline make exactly --talker-frames codec frames (the talker ignores EOS)",
    )
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--baseline-threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument(
        "--replicas",
        type=_replica_counts,
        default={},
        help="with --start-tiny: fixed replicas per stage, e.g. thinker=1,talker=2,code2wav=1 (default: autoscaling)",
    )
    parser.add_argument("--out", default="benchmarks/results.json")
    parser.add_argument(
        "--handoff-sweep",
        action="store_true",
        help="with --start-tiny: streamed vs whole thinker->talker handoffs x paced and unpaced stages x "
        "--reply-tokens x --concurrency, scenario stream-text+audio, one run (no baseline)",
    )
    parser.add_argument("--reply-tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument(
        "--pace",
        type=parse_paces,
        default=H100_PACE,
        help="the sweep's paced stages: min_step_s per stage, e.g. thinker=0.015,talker=0.012,code2wav=0.02",
    )
    parser.add_argument("--sweep-requests", type=int, nargs=2, default=[4, 16], help="requests at C=1 and at C>1")
    parser.add_argument("--pacings", nargs="+", default=["paced", "unpaced"], choices=["paced", "unpaced"])
    parser.add_argument("--ray-cpus", type=int, default=4, help="the sweep's Ray cluster: logical CPUs to schedule on")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="start graphs/tiny_omni_vllm.yaml on one CUDA GPU (tests/one_gpu.py); defaults: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in GPU_DEFAULTS.items()),
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan (graph config, runs) and start nothing")
    args = parser.parse_args()
    if args.gpu:
        gpu_mode(args, parser)
    if args.dry_run:
        print(json.dumps(plan(args), indent=2))
        return
    if args.handoff_sweep:
        handoff_sweep(args)
        return

    rows: list[dict[str, Any]] = []
    started_ray = False
    if args.start_tiny:
        import ray

        from omni_serve.cli.launch import deploy_graph_file, wait_healthy

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="serve", log_to_driver=False)
        started_ray = True
        port = int(args.url.rsplit(":", 1)[1])
        deploy_graph_file(args.graph, ray.get_runtime_context().gcs_address, port, graph_mutation(args))
        wait_healthy(args.url, timeout_s=900 if args.gpu else 300)
    try:
        for name in args.scenarios:
            stream, audio, media = SCENARIOS[name]
            messages = media_messages() if media else MESSAGES
            for concurrency in args.concurrency:
                sc = Scenario(f"graph {name}", stream, audio, concurrency, messages=messages)
                sc = asyncio.run(run_scenario(args, sc))
                rows.append(sc.summary())
                errors = [s.error for s in sc.samples if s.error]
                if errors:
                    print(f"{name} c={concurrency}: {len(errors)} errors, first: {errors[0]}")
    finally:
        if started_ray:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    if args.baseline:
        rows.append(run_baseline(args))
    report(args, rows)


# --gpu: what it changes from the CPU defaults (flags the command line gives keep their value).
GPU_DEFAULTS: dict[str, Any] = {
    "graph": "tiny_omni_vllm.yaml",
    "scenarios": ["stream-text+audio"],
    "concurrency": [1, 8],
    "requests": 16,
    "baseline": False,
}


def gpu_mode(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--gpu``: start the one-GPU graph; GPU_DEFAULTS where the command line left the CPU default."""
    if args.handoff_sweep:
        parser.error("--gpu: the handoff sweep paces CPU engines; it has no GPU mode")
    args.start_tiny = True
    for key, value in GPU_DEFAULTS.items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)
    if args.graph != GPU_DEFAULTS["graph"]:
        parser.error(f"--gpu packs {GPU_DEFAULTS['graph']} onto one GPU (tests/one_gpu.py); --graph {args.graph}?")


def graph_mutation(args: argparse.Namespace) -> Any:
    """The edit --start-tiny deploys the graph with: fixed replicas, or (--gpu) the one-GPU variant."""
    if not args.gpu:
        return _fixed(args.replicas)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/one_gpu.py: the variant's one source
    from tests.one_gpu import one_gpu

    return one_gpu()


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What a run would deploy (--start-tiny / --gpu) and measure; imports neither Ray nor an engine."""
    from omni_serve.cli.launch import load_graph_file

    config = None
    if args.start_tiny:
        config = load_graph_file(args.graph)
        graph_mutation(args)(config)
    runs = [
        {"scenario": name, "concurrency": c, "requests": args.requests}
        for name in args.scenarios
        for c in args.concurrency
    ]
    return {"url": args.url, "serve_config": config, "runs": runs, "baseline": args.baseline, "out": args.out}


def machine() -> str:
    """This machine's CPUs, and its CUDA GPU when there is one (what a figure was measured on)."""
    import torch

    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()} CPUs{gpu}"


def report(
    args: argparse.Namespace, rows: list[dict[str, Any]], summary: str = "", cols: list[str] | None = None
) -> None:
    """Write the run's JSON (args, machine, load, rows) to ``--out`` and print the table."""
    load = os.getloadavg()
    result = {"args": vars(args), "machine": machine(), "load_avg_at_end": load, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(table(rows, cols))
    if summary:
        print(summary)
    print(f"load average at the end (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def handoff_sweep(args: argparse.Namespace) -> None:
    """Streamed vs whole handoffs, paced and unpaced, over reply lengths and concurrencies, in one run."""
    import ray

    from omni_serve.cli.launch import deploy_graph_file, wait_healthy

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Logical CPUs for Ray's scheduler: --replicas may ask for more replicas x num_cpus than 4.
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, namespace="serve", log_to_driver=False)
    rows: list[dict[str, Any]] = []
    port = int(args.url.rsplit(":", 1)[1])
    try:
        for pace in [args.pace if p == "paced" else {} for p in args.pacings]:
            for streamed in (True, False):
                edit = _graph_edit(args.replicas, streamed, pace)
                deploy_graph_file(args.graph, ray.get_runtime_context().gcs_address, port, edit)
                wait_healthy(args.url, replaced=True)  # each graph after the first replaces the one before
                for tokens in args.reply_tokens:
                    for concurrency in args.concurrency:
                        label = f"{'paced' if pace else 'unpaced'} {'streamed' if streamed else 'whole'}"
                        sc = Scenario(f"{label} {tokens} tok", True, True, concurrency, reply_tokens=tokens)
                        args.requests = args.sweep_requests[0 if concurrency == 1 else 1]
                        sc = asyncio.run(run_scenario(args, sc))
                        row = {**sc.summary(), "paced": bool(pace), "streamed": streamed, "reply_tokens": tokens}
                        rows.append(row)
                        print(table([row]).splitlines()[-1], flush=True)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    report(args, rows, sweep_targets(rows))


def sweep_targets(rows: list[dict[str, Any]]) -> str:
    """The issue's targets as ratios of this run's rows."""

    def cell(paced: bool, streamed: bool, tokens: int, c: int, key: str) -> float | None:
        for r in rows:
            if (r["paced"], r["streamed"], r["reply_tokens"], r["concurrency"]) == (paced, streamed, tokens, c):
                return r.get(key)
        return None

    def ratio(a: float | None, b: float | None) -> str:
        return "–" if a is None or not b else f"{a / b:.2f}"

    tokens = sorted({r["reply_tokens"] for r in rows})
    lo, hi = tokens[0], tokens[-1]
    lines = []
    for c in sorted({r["concurrency"] for r in rows}):
        long_ttfa = cell(True, True, hi, c, "ttfa_p50")
        lines.append(
            f"C={c}: paced streamed TTFA {hi}/{lo} tok = {ratio(long_ttfa, cell(True, True, lo, c, 'ttfa_p50'))}; "
            f"paced {hi} tok streamed/whole TTFA = {ratio(long_ttfa, cell(True, False, hi, c, 'ttfa_p50'))}; "
            f"unpaced streamed/whole throughput = "
            f"{ratio(cell(False, True, lo, c, 'req_per_s'), cell(False, False, lo, c, 'req_per_s'))}, "
            f"TTFA = {ratio(cell(False, True, lo, c, 'ttfa_p50'), cell(False, False, lo, c, 'ttfa_p50'))} ({lo} tok)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
