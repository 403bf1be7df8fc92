"""The tiny random-weight Qwen3-Omni checkpoint: deterministic, loadable, safe to build concurrently."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from omni_serve import tiny

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cached() -> pathlib.Path:
    return tiny.ensure_tiny_omni()


def _same_checkpoint(a: pathlib.Path, b: pathlib.Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / name).read_text() == (b / name).read_text(), name


def test_build_is_deterministic(tmp_path: pathlib.Path, cached: pathlib.Path) -> None:
    first = tiny.build_tiny_omni(tmp_path / "a")
    second = tiny.build_tiny_omni(tmp_path / "b")
    _same_checkpoint(first, second)
    # The shared cache must hold what this code builds: bump BUILD_VERSION when the layout changes.
    _same_checkpoint(first, cached)


def test_checkpoint_is_small_and_loads(cached: pathlib.Path) -> None:
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    size = sum(f.stat().st_size for f in cached.iterdir())
    assert size < 4 * 2**20
    tokenizer = AutoTokenizer.from_pretrained(cached)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(cached)
    cfg = model.config
    # Real-model facts the serving code relies on.
    assert model.code2wav.total_upsample == tiny.SAMPLES_PER_FRAME == 1920
    assert cfg.talker_config.num_code_groups == cfg.code2wav_config.num_quantizers == 16
    assert cfg.talker_config.code_predictor_config.num_code_groups == 16
    assert cfg.talker_config.code_predictor_config.vocab_size == cfg.code2wav_config.codebook_size
    assert cfg.talker_config.text_config.vocab_size >= cfg.code2wav_config.codebook_size + 1024
    assert set(cfg.talker_config.speaker_id) == {"ethan", "chelsie", "aiden"}
    # Every special id exists in the tokenizer and the thinker vocab.
    assert len(tokenizer) == cfg.thinker_config.text_config.vocab_size == tiny.VOCAB_SIZE
    for token, token_id in tiny.TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert cfg.im_start_token_id == tiny.TOKEN_IDS["<|im_start|>"]
    assert cfg.user_token_id == tokenizer.convert_tokens_to_ids("user")


@pytest.mark.parametrize("text", ["hello", "héllo wörld — 你好 🎉", "\x00\x01\n\t ~", "user assistant system"])
def test_tokenizer_round_trips_bytes(text: str) -> None:
    tokenizer = tiny.build_byte_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tiny.VOCAB_SIZE for i in ids)
    if text.isascii() and "user" not in text:
        assert ids == list(text.encode())  # plain bytes: id == byte value


def test_chat_template_renders_chatml(cached: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cached)  # the saved one, as engines load it
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ü<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == expected
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == expected.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids[:3] == [tiny.TOKEN_IDS["<|im_start|>"], tiny.TOKEN_IDS["system"], ord("\n")]
    assert tokenizer.decode(ids) == rendered


def test_concurrent_ensure_builds_once(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "omni_serve.tiny", "--cache-dir", str(tmp_path)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert paths == {str(tmp_path / tiny.TINY_NAME)}
    # One complete checkpoint, no temporary build directories left behind.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [tiny.TINY_NAME]
    marker = json.loads((tmp_path / tiny.TINY_NAME / "omni_serve_tiny.json").read_text())
    assert marker["version"] == tiny.BUILD_VERSION
    assert tiny.ensure_tiny_omni(tmp_path) == tmp_path / tiny.TINY_NAME  # reused, not rebuilt


def test_stale_cache_is_rebuilt(tmp_path: pathlib.Path) -> None:
    stale = tmp_path / tiny.TINY_NAME
    stale.mkdir()
    (stale / "omni_serve_tiny.json").write_text(json.dumps({"version": -1}))
    path = tiny.ensure_tiny_omni(tmp_path)
    assert path == stale and (path / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [tiny.TINY_NAME]


def test_resolve_model(cached: pathlib.Path) -> None:
    assert tiny.resolve_model("tiny") == str(cached)
    assert tiny.resolve_model("Qwen/Qwen3-Omni-30B-A3B-Instruct") == "Qwen/Qwen3-Omni-30B-A3B-Instruct"
    assert tiny.resolve_model("/models/x") == "/models/x"
