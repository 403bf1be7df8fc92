"""The tiny-checkpoint registry and its CLI: one name per checkpoint, ``tiny`` per engine family."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from omni_serve import checkpoints
from omni_serve.checkpoints import tiny_glm_image, tiny_image, tiny_llm, tiny_omni, tiny_qwen3_tts, tiny_wan

REPO = pathlib.Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "omni_serve.checkpoints", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_registry_names_each_builder_once() -> None:
    assert list(checkpoints.CHECKPOINTS) == [
        "tiny-qwen3-omni",
        "tiny-qwen-image",
        "tiny-qwen-image-edit",
        "tiny-qwen3",
        "tiny-wan2.2-ti2v",
        "tiny-glm-image",
        "tiny-qwen3-tts",
    ]
    assert {c.name for c in checkpoints.CHECKPOINTS.values()} == {
        tiny_omni.TINY_NAME,
        tiny_image.TINY_NAME,
        tiny_image.TINY_EDIT_NAME,
        tiny_llm.TINY_LLM_NAME,
        tiny_wan.TINY_NAME,
        tiny_glm_image.TINY_NAME,
        tiny_qwen3_tts.TINY_NAME,
    }


def test_resolve_builds_registered_names_and_passes_the_rest_through(tmp_path: pathlib.Path) -> None:
    path = checkpoints.resolve("tiny-qwen3", cache_dir=tmp_path)
    assert path == str(tmp_path / "tiny-qwen3") and (tmp_path / "tiny-qwen3" / "config.json").exists()
    assert checkpoints.resolve("tiny", tiny="tiny-qwen3", cache_dir=tmp_path) == path  # a family's own tiny
    for other in ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "/models/x", "tiny-unknown"):
        assert checkpoints.resolve(other, cache_dir=tmp_path) == other
    with pytest.raises(KeyError, match="tiny-unknown"):
        checkpoints.ensure("tiny-unknown", tmp_path)


def test_import_is_cheap() -> None:
    code = (
        "import sys, omni_serve.checkpoints; "
        "heavy = [m for m in ('torch', 'transformers', 'diffusers') if m in sys.modules]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_cli_builds_and_prints_the_path(tmp_path: pathlib.Path) -> None:
    done = cli("tiny-qwen3", "--cache-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "tiny-qwen3")
    assert "building checkpoint tiny-qwen3" in done.stderr
    again = cli("tiny-qwen3", "--cache-dir", str(tmp_path))
    assert again.stdout == done.stdout and "building" not in again.stderr  # cached


def test_cli_refuses_unknown_names_listing_the_known() -> None:
    done = cli("tiny-nothing")
    assert done.returncode == 2 and "tiny-nothing" in done.stderr
    listing = cli("--help").stdout
    assert all(name in listing for name in ("tiny", *checkpoints.CHECKPOINTS))


@pytest.mark.vllm_cpu
def test_tiny_qwen3_tts_builds_the_same_bytes_every_time(tmp_path: pathlib.Path) -> None:
    """The cached build and a new one are byte for byte the same (the seed drives every tensor, nothing else does)."""
    from tests.deps import require

    require("vllm_omni", "its Qwen3-TTS config classes and modules build the checkpoint; make test installs it")
    require("torchaudio", "vLLM-Omni's Qwen3-TTS modules import it; make test installs it")
    cached = checkpoints.ensure(tiny_qwen3_tts.TINY_NAME)
    again = tiny_qwen3_tts.build_tiny_qwen3_tts(tmp_path / "again")
    files = sorted(p.relative_to(cached) for p in cached.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert {pathlib.Path("model.safetensors"), pathlib.Path("speech_tokenizer/model.safetensors")} <= set(files)
    for name in files:
        assert (cached / name).read_bytes() == (again / name).read_bytes(), name
