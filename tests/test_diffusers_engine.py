"""The diffusers engine in-process on the tiny Qwen-Image: one stage and encode -> denoise -> decode agree.

The integration tests (tests/test_images_api.py) cover the same engine behind Serve and HTTP.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import numpy as np
import pytest
import torch

from omni_serve.engines import validate_engine_args
from omni_serve.engines.diffusers import LATENTS_KIND, PROMPT_KIND, DiffusersEngine, create
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.payload import HandoffPayload
from omni_serve.types import ChatMessage, ImageParams, SamplingParams, StageOutput, StageRequest

STAGES = ("full", "encode", "denoise", "decode")


@pytest.fixture(scope="module")
def engines() -> dict[str, DiffusersEngine]:
    async def start() -> dict[str, DiffusersEngine]:
        made = {s: create(s, {"model": "tiny", "pipeline_stage": s}) for s in STAGES}
        for engine in made.values():
            await engine.start()
        return made  # type: ignore[return-value]

    return asyncio.run(start())


def request(prompt: str = "a red fox", **image: Any) -> StageRequest:
    params = {"width": 64, "height": 48, "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 7, "n": 1, **image}
    return StageRequest(
        request_id="r1",
        sampling=SamplingParams(),
        messages=[ChatMessage(role="system", content="be nice"), ChatMessage(role="user", content=prompt)],
        image=ImageParams(**params),
    )


def run(engine: DiffusersEngine, req: StageRequest, handoff: HandoffPayload | None = None) -> StageOutput:
    async def collect() -> list[StageOutput]:
        return [o async for o in engine.stream(req, handoff)]

    outputs = asyncio.run(collect())
    assert len(outputs) == 1 and outputs[0].finished
    return outputs[0]


def three_stage(engines: dict[str, DiffusersEngine], req: StageRequest) -> list[np.ndarray]:
    embeds = run(engines["encode"], req).handoff
    # What crosses a stage boundary is pickled through the object store.
    latents = run(engines["denoise"], req, pickle.loads(pickle.dumps(embeds))).handoff
    assert (embeds.kind, latents.kind) == (PROMPT_KIND, LATENTS_KIND)
    return run(engines["decode"], req, pickle.loads(pickle.dumps(latents))).images


@pytest.mark.parametrize("negative_prompt", [None, "blurry"], ids=["no-cfg", "true-cfg"])
def test_one_stage_equals_three_stages_and_diffusers(engines: dict[str, DiffusersEngine], negative_prompt) -> None:
    import torch
    from diffusers import QwenImagePipeline

    from omni_serve.checkpoints.tiny_image import ensure_tiny_qwen_image

    req = request(negative_prompt=negative_prompt, n=2)
    full = run(engines["full"], req).images
    assert [i.shape for i in full] == [(48, 64, 3)] * 2 and all(i.dtype == np.uint8 for i in full)
    assert not np.array_equal(full[0], full[1])  # seed, seed + 1
    assert all(np.array_equal(a, b) for a, b in zip(full, three_stage(engines, req), strict=True))

    # The same pixels as diffusers' own end-to-end call with per-image generators.
    pipe = QwenImagePipeline.from_pretrained(ensure_tiny_qwen_image())
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(
        prompt="a red fox",
        negative_prompt=negative_prompt,
        true_cfg_scale=4.0 if negative_prompt else 1.0,
        width=64,
        height=48,
        num_inference_steps=2,
        num_images_per_prompt=2,
        generator=[torch.Generator().manual_seed(7 + i) for i in range(2)],
        output_type="np",
    ).images
    np.testing.assert_array_equal((reference * 255).round().astype(np.uint8), np.stack(full))


def test_deterministic_per_seed(engines: dict[str, DiffusersEngine]) -> None:
    first, again = (run(engines["full"], request(seed=11)).images[0] for _ in range(2))
    other = run(engines["full"], request(seed=12)).images[0]
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    # n images from seed s: image i is what seed s + i gives alone.
    pair = run(engines["full"], request(seed=11, n=2)).images
    np.testing.assert_allclose(pair[1].astype(int), other.astype(int), atol=1)


def test_chat_style_request_uses_stage_defaults_and_sampling_seed() -> None:
    engine = DiffusersEngine("image", {"model": "tiny", "default_width": 32, "default_height": 16})
    req = request()
    req.image, req.sampling = None, SamplingParams(seed=3)
    params = engine.image_params(req)
    assert (params.width, params.height, params.seed, params.n) == (32, 16, 3, 1)


@pytest.mark.parametrize(
    ("image", "field"),
    [
        ({"width": 50}, "size"),
        ({"height": 0}, "size"),
        ({"width": 4096, "height": 4096}, "size"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"num_inference_steps": 101}, "num_inference_steps"),
        ({"n": 5}, "n"),
    ],
)
def test_invalid_params_name_the_field(engines: dict[str, DiffusersEngine], image: dict, field: str) -> None:
    for stage in ("full", "encode", "denoise"):
        with pytest.raises(InvalidStageInput, match=rf"^{field}: "):
            run(engines[stage], request(**image), None)


def test_missing_prompt_and_wrong_handoff(engines: dict[str, DiffusersEngine]) -> None:
    req = request()
    req.messages = [ChatMessage(role="system", content="no user turn")]
    with pytest.raises(InvalidStageInput, match="^messages: "):
        run(engines["full"], req)
    with pytest.raises(EngineError, match="expected a 'qwen_image.latents' handoff"):
        run(engines["decode"], request(), HandoffPayload(kind=PROMPT_KIND, tensors={}))


def test_cancelled_request_stops_denoising() -> None:
    engine = DiffusersEngine("image", {"model": "tiny", "max_inference_steps": 20000})

    async def cancel_midway() -> None:
        await engine.start()
        # 20000 steps take minutes; cancelled after 0.5 s, the loop must stop at its next step.
        task = asyncio.create_task(anext(aiter(engine.generate(request(num_inference_steps=20000), None))))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        output = await asyncio.wait_for(anext(aiter(engine.stream(request(), None))), 10)
        assert output.images

    asyncio.run(cancel_midway())
    where = "cuda" if torch.cuda.is_available() else "cpu"  # device "auto"
    assert engine.stats() == {"waiting_or_running": 0, "served": 1, "device": where}


def test_engine_args_are_validated_with_the_field_named() -> None:
    assert validate_engine_args("diffusers", {"model": "tiny", "pipeline_stage": "denoise"}) is None
    assert "pipeline_stage" in validate_engine_args("diffusers", {"pipeline_stage": "vae"})
    assert "max_sequence_length" in validate_engine_args("diffusers", {"max_sequence_length": 4096})
    assert "unknown" in validate_engine_args("diffusers", {"unknown": 1})


def test_bf16_handoffs_stay_two_bytes_a_value() -> None:
    """A bf16 pipeline (as on GPUs) hands off its prompt embeddings and latents unwidened, and the
    split stages still give the one-stage image."""

    async def start() -> dict[str, DiffusersEngine]:
        made = {s: create(s, {"model": "tiny", "pipeline_stage": s, "dtype": "bfloat16"}) for s in STAGES}
        for engine in made.values():
            await engine.start()
        return made  # type: ignore[return-value]

    bf16 = asyncio.run(start())
    req = request()
    embeds = run(bf16["encode"], req).handoff
    latents = run(bf16["denoise"], req, pickle.loads(pickle.dumps(embeds))).handoff
    for payload, name in ((embeds, "prompt_embeds"), (latents, "latents")):
        assert payload.meta["dtypes"].get(name) == "bfloat16" and payload.tensors[name].dtype == np.int16, name
    one, split = run(bf16["full"], req).images, three_stage(bf16, req)
    assert len(one) == len(split) == 1 and np.array_equal(one[0], split[0])
