"""omni_serve's graph of a vLLM-Omni family against native vLLM-Omni (``vllm-omni serve --omni``), same checkpoint.

    python benchmarks/vs_vllm_omni_family.py           # Qwen3-TTS; 3 rounds; c=1 and c=4, 4 requests a client
    python benchmarks/vs_vllm_omni_family.py --family voxtral_tts --rounds 2 --concurrency 1
    python benchmarks/vs_vllm_omni_family.py --family ming_flash_omni
    python benchmarks/vs_vllm_omni_family.py --family qwen2_5_omni --pace thinker=0.03,talker=0.03,code2wav=0.05
    python benchmarks/vs_vllm_omni_family.py --family hunyuan_video_15 --rounds 2 --requests-per-client 2

(Qwen3-Omni, with its async-chunk modes and GPU mode, has its own: ``vs_vllm_omni.py``.) Both servers on vLLM-Omni
0.30 stage engines with omni_serve's CPU platform, in the mode vLLM-Omni's deploy config turns on (async chunks for
the TTS families, none for Ming-flash-omni): native runs vLLM-Omni's shipped deploy config of the family made for
CPU (``tests/native_omni.cpu_deploy_config``, the oracle's); omni_serve the family's tiny graph (:data:`FAMILIES`)
with one fixed replica a stage behind Serve's HAProxy ingress (as ``make serve`` starts it). The load, one seed a
request, by the route the family's users call:

- a TTS family: ``/v1/audio/speech`` with a preset voice, raw PCM (``stream: true``, ``stream_format: "audio"``:
  both servers' fields); a seed gives both servers the same frames (tests/test_qwen3_tts_cpu.py; Voxtral's
  tiny checkpoint gives the same frames whatever the seed: tests/test_voxtral_tts_cpu.py): each request's two
  replies are checked to be the same length;
- a lone video DiT (HunyuanVideo-1.5): ``/v1/videos`` jobs, 48x32, 9 frames, 2 steps, guidance 4 (sent: the
  two servers' defaults differ), made, polled every 50 ms and
  downloaded (e2e: create to the MP4's last byte; TTFA is e2e); native runs vLLM-Omni's CLI on the checkpoint
  with the graph's dtype (float32), no deploy config (the oracle's, tests/test_hunyuan_video_cpu.py), and a
  seed gives both servers the same MP4, byte for byte, checked per request; ``--pace`` is refused for it;
- a speech-to-speech family (Ming-flash-omni): ``/v1/chat/completions`` with text and audio out, the thinker's
  16 tokens, whole (not streamed: streamed, native vLLM-Omni 0.30's talker speaks only the thinker's last text
  delta, 1.9 s of audio where the whole reply speaks 15.6 s, while omni_serve's speaks the whole text; whole,
  both speak the whole text); a seed gives both servers the same text (tests/test_ming_flash_omni_cpu.py),
  checked per request; the talker's audio is not a function of the request on either server (its noise comes
  from the process's generator), so its length varies from reply to reply on both (``audio_s_per_request``);
  Qwen2.5-Omni's the same way, native on the graph's own configuration (its thinker greedy: the same text; native
  samples its talker from the deploy config's seed, omni_serve from the request's, so their lengths may differ).

Per concurrency: e2e p50 (the whole body), TTFA p50 (the first audio byte; a whole chat reply's: e2e) and req/s;
rounds alternate which server goes first. It prints the median of each figure over the rounds and omni_serve / native.

``--pace qwen3_tts=0.06,code2wav=0.04`` (seconds per engine step, by the family graph's stage names): each engine
step of both servers lasts at least that long, the rest waited without a core (omni_serve's CPU platform paces native's
engines as it paces omni_serve's, through the stage's ``additional_config``). Above the tiny models' own CPU step,
the wait, not the arithmetic, sets each stage's time, as if each owned an accelerator, and the 2 shared cores are
left to the serving path: what a GPU host would show of each server's own overhead. Unpaced, the engines'
arithmetic competes with both servers' processes for the two cores.
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
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_native  # noqa: E402  (the server plumbing the comparisons share)
from bench import parse_paces  # noqa: E402

# Per family (tests/native_omni.py's name): its tiny graph, its route, and the voice asked. Voxtral's casual_male:
# its reply ends on its own (24 frames); neutral_female's runs to max_tokens, which omni_serve reports as a cut-off
# stream.
FAMILIES = {
    "qwen3_tts": {"graph": "tiny_qwen3_tts_vllm_omni.yaml", "model": "tiny-qwen3-tts", "voice": "vivian"},
    "voxtral_tts": {"graph": "tiny_voxtral_tts_vllm_omni.yaml", "model": "tiny-voxtral-tts", "voice": "casual_male"},
    "ming_flash_omni": {"graph": "tiny_ming_flash_omni_vllm_omni.yaml", "model": "tiny-ming-flash-omni", "chat": "1"},
    # Native serves the graph's own configuration (the oracle's, tests/test_qwen2_5_omni_cpu.py): no tests/native_omni
    # family of its own.
    "qwen2_5_omni": {
        "graph": "tiny_qwen2_5_omni_vllm_omni.yaml",
        "model": "tiny-qwen2.5-omni",
        "chat": "1",
        "native": "graph",
    },
    "hunyuan_video_15": {"graph": "tiny_hunyuan_video_15.yaml", "model": "tiny-hunyuan-video-1.5", "video": "1"},
}
# Guidance sent: the two servers' defaults differ (the graph's default_guidance_scale, the pipeline's own).
VIDEO = {"prompt": "a red fox", "size": "48x32", "num_frames": 9, "fps": 8, "num_inference_steps": 2}
VIDEO |= {"guidance_scale": 4.0}
TEXT = "Hello from the tiny talker, reading a short line for the benchmark."
METRICS = ("e2e_p50_ms", "ttfa_p50_ms", "request_throughput")


class Reply(NamedTuple):
    ttfa_s: float
    e2e_s: float
    audio_s: float
    same: Any  # what a seed makes the same on both servers: the audio's length (TTS) or the text (chat)


async def speech(client: Any, base: str, family: dict[str, str], seed: int) -> Reply:
    """One speech request, raw 24 kHz PCM streamed."""
    body = {"model": family["model"], "input": TEXT, "voice": family["voice"], "response_format": "pcm", "seed": seed}
    started = time.perf_counter()
    first, size = None, 0
    url = f"{base}/v1/audio/speech"
    async with client.stream("POST", url, json={**body, "stream": True, "stream_format": "audio"}) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: {reply.status_code} {(await reply.aread())[:300]!r}")
        async for piece in reply.aiter_bytes():
            if piece and first is None:
                first = time.perf_counter() - started
            size += len(piece)
    return Reply(first or 0.0, time.perf_counter() - started, size / 2 / 24000, size)


async def chat(client: Any, base: str, family: dict[str, str], seed: int) -> Reply:
    """One chat request with text and audio out, whole: the first audio comes with the whole body."""
    import soundfile as sf

    body = {
        "model": family["model"], "messages": [{"role": "user", "content": TEXT}], "modalities": ["text", "audio"],
        "max_tokens": 16, "seed": seed,
    }  # fmt: skip
    started = time.perf_counter()
    reply = await client.post(f"{base}/v1/chat/completions", json=body)
    e2e = time.perf_counter() - started
    if reply.status_code != 200:
        raise RuntimeError(f"{base}: {reply.status_code} {reply.text[:300]!r}")
    (choice,) = reply.json()["choices"]
    audio = sf.info(io.BytesIO(base64.b64decode(choice["message"]["audio"]["data"])))
    return Reply(e2e, e2e, audio.duration, choice["message"]["content"])


async def video(client: Any, base: str, family: dict[str, str], seed: int) -> Reply:
    """One video job: created (multipart, as OpenAI's client sends it), polled, its MP4 downloaded, then deleted."""
    import hashlib

    form = {k: (None, str(v)) for k, v in {"model": family["model"], **VIDEO, "seed": seed}.items()}
    started = time.perf_counter()
    created = await client.post(f"{base}/v1/videos", files=form)
    if created.status_code != 200:
        raise RuntimeError(f"{base}: {created.status_code} {created.text[:300]!r}")
    job = created.json()
    while job["status"] not in ("completed", "failed"):
        await asyncio.sleep(0.05)
        job = (await client.get(f"{base}/v1/videos/{job['id']}")).json()
    if job["status"] != "completed":
        raise RuntimeError(f"{base}: job {job}")
    mp4 = (await client.get(f"{base}/v1/videos/{job['id']}/content")).content
    e2e = time.perf_counter() - started
    gone = await client.delete(f"{base}/v1/videos/{job['id']}")  # a finished job holds a slot until it expires
    if gone.status_code != 200:
        raise RuntimeError(f"{base}: delete {job['id']}: {gone.status_code} {gone.text[:300]!r}")
    return Reply(e2e, e2e, 0.0, hashlib.sha256(mp4).hexdigest())


def native_server(args: argparse.Namespace, family: dict[str, str], port: int, logs: Path) -> Any:
    """Native vLLM-Omni for ``family``: a lone DiT from its checkpoint with the graph's dtype; the others from
    vLLM-Omni's deploy config made for CPU (``tests/native_omni``), paced like the graph."""
    from tests import native_omni, vllm_cli

    if family.get("video"):
        from omni_serve.checkpoints import ensure

        (stage,) = graph_stages(family["graph"])
        argv = vllm_cli.argv(
            "vllm-omni", "serve", str(ensure(family["model"])), "--omni", "--dtype", stage["engine_args"]["dtype"],
            "--served-model-name", family["model"], "--host", "127.0.0.1", "--port", str(port),
        )  # fmt: skip
        return vs_native.server(argv, f"http://127.0.0.1:{port}/v1/models", logs / "native.log")
    min_step_s = stage_ids(family["graph"], args.pace)
    if family.get("native") == "graph":
        return graph_native(family, port, logs, min_step_s)
    return native_omni.serve(args.family, port, logs / "native.log", async_chunk=True, min_step_s=min_step_s)


def graph_native(family: dict[str, str], port: int, logs: Path, min_step_s: dict[int, float]) -> Any:
    """Native vLLM-Omni on the family graph's own configuration (``native_omni.graph_deploy_config``, whole
    handoffs), paced like the graph."""
    from omni_serve.checkpoints import ensure
    from tests import native_omni, vllm_cli

    config = native_omni.graph_deploy_config(graph_stages(family["graph"]), async_chunk=False, min_step_s=min_step_s)
    deploy = logs / "native.deploy.yaml"
    deploy.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = vllm_cli.argv(
        "vllm-omni", "serve", str(ensure(family["model"])), "--omni", "--deploy-config", str(deploy),
        "--no-async-chunk", "--served-model-name", family["model"], "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    return vs_native.server(argv, f"http://127.0.0.1:{port}/v1/models", logs / "native.log")


async def load(port: int, family: dict[str, str], concurrency: int, requests: int, seed: int) -> dict[str, Any]:
    import httpx

    one = video if family.get("video") else chat if family.get("chat") else speech
    base = f"http://127.0.0.1:{port}"
    seeds = iter(range(seed, seed + requests))
    results: dict[int, Reply] = {}

    async def client_loop(client: httpx.AsyncClient) -> None:
        for s in seeds:
            results[s] = await one(client, base, family, s)

    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {
        "e2e_p50_ms": 1000 * statistics.median(r.e2e_s for r in results.values()),
        "ttfa_p50_ms": 1000 * statistics.median(r.ttfa_s for r in results.values()),
        "request_throughput": requests / wall,
        "audio_s_per_request": statistics.mean(r.audio_s for r in results.values()),
        "same": {s: r.same for s, r in sorted(results.items())},
    }


def graph_stages(graph: str) -> list[dict[str, Any]]:
    config = yaml.safe_load((ROOT / "graphs" / graph).read_text())
    return config["applications"][0]["args"]["stages"]


def stage_ids(graph: str, pace: dict[str, float]) -> dict[int, float]:
    """``--pace`` by the graph's stage names -> by vLLM-Omni's stage ids (native's deploy config)."""
    ids = {stage["name"]: stage["engine_args"]["stage_id"] for stage in graph_stages(graph)}
    unknown = set(pace) - set(ids)
    if unknown:
        raise SystemExit(f"--pace: no stage {sorted(unknown)} in {graph} (its stages: {sorted(ids)})")
    return {ids[name]: seconds for name, seconds in pace.items()}


def paced(pace: dict[str, float]) -> Any:
    """omni_serve's graph edit: one fixed replica a stage, each paced stage's ``engine_args.min_step_s``."""

    def mutate(config: dict[str, Any]) -> None:
        vs_native.fixed_replicas(config)
        for stage in config["applications"][0]["args"]["stages"]:
            if stage["name"] in pace:
                stage["engine_args"]["min_step_s"] = pace[stage["name"]]

    return mutate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_tts")
    parser.add_argument("--port", type=int, default=19260, help="native PORT, omni_serve PORT+1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="default: benchmarks/results_vs_vllm_omni_FAMILY.json")
    parser.add_argument("--logs", default=os.environ.get("TMPDIR", "/tmp"))
    parser.add_argument(
        "--pace",
        type=parse_paces,
        default={},
        help="min_step_s per stage of both servers, e.g. qwen3_tts=0.06,code2wav=0.04",
    )
    parser.add_argument("--serve-omni", type=int, help=argparse.SUPPRESS)  # the omni_serve child process
    args = parser.parse_args()
    family = FAMILIES[args.family]
    if args.serve_omni:
        vs_native.serve_omni(args.serve_omni, "haproxy", family["graph"], mutate=paced(args.pace), stats_stage=None)
        return
    args.out = args.out or f"benchmarks/results_vs_vllm_omni_{args.family}.json"
    if family.get("video") and args.pace:
        raise SystemExit("--pace: not wired for a video family yet (native is started without a deploy config)")

    logs = Path(tempfile.mkdtemp(prefix="vs_vllm_omni_family_", dir=args.logs))
    ports = {"native": args.port, "omni": args.port + 1}
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {c: {"native": [], "omni": []} for c in args.concurrency}
    pace = ",".join(f"{name}={seconds}" for name, seconds in args.pace.items())
    omni_argv = [sys.executable, __file__, "--family", args.family, "--serve-omni", str(ports["omni"])]
    omni_argv += ["--pace", pace] if pace else []
    with (
        native_server(args, family, ports["native"], logs),
        vs_native.server(omni_argv, f"http://127.0.0.1:{ports['omni']}/health", logs / "omni.log"),
    ):
        for port in ports.values():  # warm-up, not counted
            asyncio.run(load(port, family, max(args.concurrency), max(args.concurrency), args.seed))
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                order = list(ports) if round_ % 2 == 0 else list(reversed(ports))
                pair = {}
                for name in order:
                    n = args.requests_per_client * concurrency
                    pair[name] = asyncio.run(load(ports[name], family, concurrency, n, args.seed + 1000 * round_))
                    figures = {k: v for k, v in pair[name].items() if k != "same"}
                    print(f"round {round_ + 1} c={concurrency} {name}: {json.dumps(figures)}", flush=True)
                    runs[concurrency][name].append(pair[name])
                if pair["native"]["same"] != pair["omni"]["same"]:  # what a seed fixes must be the same on both
                    raise SystemExit(f"replies differ: {pair['native']['same']} {pair['omni']['same']}")
    summary: dict[str, Any] = {}
    reported = (*METRICS, *(() if family.get("video") else ("audio_s_per_request",)))  # a video carries no audio
    for concurrency, by_server in runs.items():
        row: dict[str, Any] = {}
        for key in reported:
            values = {name: statistics.median(r[key] for r in rs) for name, rs in by_server.items()}
            row[key] = {**values, "ratio": values["omni"] / values["native"]}
        summary[f"c={concurrency}"] = row
    Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary, "runs": runs}, indent=1))
    print("| figure (median of rounds) | native vLLM-Omni | omni_serve | omni / native |")
    print("|---|---|---|---|")
    for label, row in summary.items():
        for key in reported:
            f = row[key]
            print(f"| {label} {key} | {f['native']:.3f} | {f['omni']:.3f} | {f['ratio']:.2f} |")


if __name__ == "__main__":
    main()
