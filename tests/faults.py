"""The faults graph (two padded talkers), its request, and finding a stage's replica processes to kill."""

from __future__ import annotations

import base64
import contextlib
import io
import os

import pytest
import soundfile as sf

from omni_serve.models.qwen3_omni import SAMPLE_RATE
from tests.conftest import graph_variant

TALKER_FRAMES = 40  # greedy: the tiny talker never samples codec EOS, so every reply has exactly this many frames


BODY = {
    "model": "tiny-qwen3-omni",
    "messages": [{"role": "user", "content": "Say something."}],
    "modalities": ["text", "audio"],
    "audio": {"format": "wav"},
    "max_tokens": 6,
    "seed": 11,
    "stage_sampling": {"talker": {"temperature": 0.0, "max_tokens": TALKER_FRAMES}},
}


CLIENT_TIMEOUT_S = 150  # above the graph's request_timeout_s (120): a hang shows as a client timeout


# One replica per stage but two talkers, every handoff padded to 1 MiB (the stages' run-time setting, so the
# variant is deployed over the running graph in place): one deploy for this module and
# tests/test_handoff_store.py (its object-store checks need the padding; here it loads the store as production's
# MiB handoffs would). Serve replaces the replica killed here before that module's tests start (Graphs.ensure).
HANDOFF_PADDING = 1 << 20


TWO_PADDED_TALKERS = graph_variant(
    fixed_replicas={"*": 1, "talker": 2},
    deployments={
        stage: {"user_config": {"handoff_padding_bytes": HANDOFF_PADDING}}
        for stage in ("thinker", "talker", "code2wav")
    },
)


SHARED_GRAPH = pytest.mark.shares_graph("tiny_omni.yaml with TWO_PADDED_TALKERS (tests/test_faults.py)")


def samples(b64: str) -> int:
    data, rate = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")
    assert rate == SAMPLE_RATE
    return len(data)


def replica_names(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::omni#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def replica_pid(deployment: str) -> int:
    """The process id of the deployment's one replica."""
    import ray

    [replica] = replica_names(deployment)
    return int(ray.get(ray.get_actor(replica, namespace="serve").__ray_call__.remote(lambda _self: os.getpid())))


def vllm_processes(pid: int) -> dict[int, str]:
    """The vLLM processes under a process (pid -> command line): its EngineCore and any worker, not the helpers
    (multiprocessing's resource tracker).

    Told apart from the helper by what it is, not by vLLM's title (``VLLM::...``, set with setproctitle once the
    process runs): in two full-suite runs a thinker's EngineCore kept multiprocessing's spawn command line for 30 s
    and more while it served (2026-11-30; not reproduced alone), and a test looking for the title found none."""
    import psutil

    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile
            found[child.pid] = " ".join(child.cmdline())
    return {p: cmdline for p, cmdline in found.items() if "multiprocessing.resource_tracker" not in cmdline}
