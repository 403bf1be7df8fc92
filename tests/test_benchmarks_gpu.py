"""The benchmarks' GPU mode, checked where there is no GPU: its plans (``--dry-run``) and its client.

``benchmarks/vs_vllm_omni.py --gpu`` and ``benchmarks/bench.py --gpu`` run on a lent GPU machine in one
device call (``.gpu/run_gpu_checks.sh bench``): what they would start and measure is checked here, by
running their ``--dry-run`` as a user does, so a mistake costs no device time. The client both servers
are measured with (bench.py's) is checked against the two streaming shapes it must read: omni_serve's
audio in ``delta.audio.data``, native vLLM-Omni's in ``delta.content``, both marked ``"modality": "audio"``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import yaml

from benchmarks import bench, vs_vllm_omni
from tests.one_gpu import SHARES, gpu_config, gpu_shares, stages

ROOT = Path(__file__).resolve().parent.parent


def dry_run(script: str, *args: str) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--gpu", "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    logs = tmp_path_factory.mktemp("vs_vllm_omni")
    return {"logs": logs, **dry_run("vs_vllm_omni.py", "--logs", str(logs))}


def test_vs_vllm_omni_gpu_puts_both_servers_on_one_gpu_with_the_same_engines(plan: dict[str, Any]) -> None:
    omni = stages(plan["omni_serve_config"])
    native = {s["stage_id"]: s for s in plan["native_deploy_config"]["stages"]}
    assert plan["gpu_shares"]["omni_serve"] == vs_vllm_omni.GPU_SHARES
    assert plan["gpu_shares"]["sum"] <= 1  # both servers side by side on the one GPU
    for name, stage in omni.items():
        engine = stage["engine_args"]["engine"]
        entry = native[stage["engine_args"]["stage_id"]]
        assert entry["devices"] == "0" and engine["gpu_memory_utilization"] == vs_vllm_omni.GPU_SHARES[name]
        # The same engine on both sides: every deploy setting (the pipeline declares the rest for both).
        assert {k: entry[k] for k in engine} == engine, name
        assert engine["dtype"] == "bfloat16", name
    assert plan["native_deploy_config"]["async_chunk"] is True  # bfloat16 everywhere: native's async-chunk path
    # Both talkers make the same fixed-length audio: min_tokens = max_tokens on both.
    talker = omni["talker"]["default_sampling"]
    assert talker["min_tokens"] == talker["max_tokens"] == native[1]["default_sampling_params"]["min_tokens"]


def test_vs_vllm_omni_gpu_commands_and_runs(plan: dict[str, Any]) -> None:
    native, omni = plan["servers"]["native"], plan["servers"]["omni"]
    deploy = Path(native[native.index("--deploy-config") + 1])
    assert deploy.parent == plan["logs"] and yaml.safe_load(deploy.read_text()) == plan["native_deploy_config"]
    assert native[native.index("--served-model-name") + 1] == vs_vllm_omni.MODEL and "--no-async-chunk" not in native
    assert omni[omni.index("--ingress") + 1] == "proxy" and "--gpu" in omni  # no HAProxy in the GPU kit
    runs = plan["runs"]
    assert [(r["round"], r["concurrency"]) for r in runs[::2]] == [(1, 1), (1, 8), (2, 1), (2, 8)]
    assert [r["server"] for r in runs] == ["native", "omni"] * 2 + ["omni", "native"] * 2  # alternating
    assert {r["concurrency"]: r["requests"] for r in runs} == {1: 8, 8: 16}


def test_vs_vllm_omni_gpu_refuses_what_it_cannot_run() -> None:
    script = str(ROOT / "benchmarks" / "vs_vllm_omni.py")
    for args, error in ((["--gpu", "--modes", "off", "--dry-run"], "async_chunk on only"), (["--dry-run"], "--gpu")):
        run = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 2 and error in run.stderr, run.stderr


def test_bench_gpu_plan_is_the_one_gpu_graph() -> None:
    plan = dry_run("bench.py")
    assert plan["serve_config"] == gpu_config() and gpu_shares(plan["serve_config"]) == SHARES
    assert plan["baseline"] is False
    assert [(r["scenario"], r["concurrency"]) for r in plan["runs"]] == [
        ("stream-text+audio", 1),
        ("stream-text+audio", 8),
    ]
    # A flag the command line gives keeps its value.
    assert [r["concurrency"] for r in dry_run("bench.py", "--concurrency", "4")["runs"]] == [4]


def wav_base64(seconds: float) -> str:
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros(int(24000 * seconds), dtype=np.float32), 24000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("shape", ["omni_serve", "native"])
def test_the_client_reads_audio_chunks_in_either_servers_shape(shape: str) -> None:
    """TTFT from the first text delta only, TTFA from the first audio chunk, the seconds of audio decoded."""

    def audio(seconds: float) -> dict[str, Any]:
        data = wav_base64(seconds)
        delta = {"audio": {"data": data}} if shape == "omni_serve" else {"content": data}
        return {"modality": "audio", "choices": [{"index": 0, "delta": delta}]}

    text = {"modality": "text", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    sent: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=sse(audio(0.32), text, audio(1.0)))

    args = argparse.Namespace(url="http://server", model="m", max_tokens=16, requests=1, timeout=10)
    scenario = bench.Scenario("s", stream=True, audio=True, concurrency=1, omni_fields=False)

    async def one() -> bench.Sample:
        async with httpx.AsyncClient(base_url=args.url, transport=httpx.MockTransport(answer)) as client:
            return await bench._one(client, args, scenario, seed=1)

    sample = asyncio.run(one())
    assert sample.error is None, sample.error
    assert sample.ttfa is not None and sample.ttft is not None and sample.ttfa < sample.ttft  # audio came first
    assert sample.audio_s == pytest.approx(1.32)
    # OpenAI's fields only: the native server runs its own stage defaults.
    assert "stage_sampling" not in sent[0] and "return_stage_metrics" not in sent[0]
    assert sent[0]["modalities"] == ["text", "audio"] and sent[0]["stream"] is True
