"""The invalid-parameter cases of the image, edit and video routes, and the check every case runs."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

# omni_serve takes the value: a deliberate difference from vLLM-Omni's case, said in docs/api.md.
ACCEPTED = 200


@dataclass(frozen=True)
class Case:
    id: str
    request: dict[str, Any]  # httpx's request arguments: json / content / data / files / params
    status: int  # what omni_serve answers (vLLM-Omni's status unless the case's comment says otherwise)
    names: tuple[str, ...]  # the error names one of these (param or message)
    method: str = "POST"


def cases(*items: Case) -> Any:
    return pytest.mark.parametrize("case", items, ids=[c.id for c in items])


def check(base_url: str, route: str, case: Case) -> None:
    """``case`` sent to ``route``: its status, and an OpenAI error naming one of its fields."""
    reply = httpx.request(case.method, f"{base_url}{route}", timeout=120, **case.request)
    if case.status == ACCEPTED:  # not refused for this field (the graph may refuse something else of the body)
        if reply.status_code != 200:
            error = reply.json()["error"]
            assert not any(n in f"{error['param']} {error['message']}" for n in case.names), error
        return
    assert reply.status_code == case.status, reply.text[:500]
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    said = f"{error['param']} {error['message']}"
    assert any(name in said for name in case.names), error
    assert "Traceback" not in error["message"]


JSON = {"content-type": "application/json"}


IMAGE_MODEL = "tiny-qwen-image"


def image(**overrides: Any) -> dict[str, Any]:
    return {"json": {"prompt": "a simple red apple icon", "model": IMAGE_MODEL, **overrides}}


IMAGE_GENERATION_CASES = (
    Case("missing_prompt", {"json": {"size": "1024x1024"}}, 400, ("prompt",)),
    Case("model_mismatch", image(prompt="cat", model="not-the-loaded-checkpoint"), 404, ("model",)),  # theirs: 400
    Case("prompt_empty", image(prompt=""), 400, ("prompt",)),
    Case("prompt_whitespace_only", image(prompt="   "), 400, ("prompt",)),
    Case("prompt_wrong_type", image(prompt=123), 400, ("prompt",)),
    Case("n_below_min", image(n=0), 400, ("n",)),
    Case("n_above_max", image(n=11), 400, ("n",)),
    Case("size_missing_height_token", image(size="1024"), 400, ("size",)),
    Case("size_missing_separator", image(size="not-a-size"), 400, ("size",)),
    Case("size_non_integer_height", image(size="1024xabc"), 400, ("size",)),
    Case("size_incomplete_height", image(size="1024x"), 400, ("size",)),
    Case("size_non_positive_width", image(size="0x1024"), 400, ("size",)),
    Case("response_format_not_b64_json", image(response_format="url"), 400, ("response_format",)),
    Case("use_system_prompt_invalid", image(use_system_prompt="bogus"), 400, ("use_system_prompt",)),
    Case("num_inference_steps_below_min", image(num_inference_steps=0), 400, ("num_inference_steps",)),
    Case("num_inference_steps_above_max", image(num_inference_steps=201), 400, ("num_inference_steps",)),
    Case("guidance_scale_negative", image(guidance_scale=-1.0), 400, ("guidance_scale",)),
    Case("guidance_scale_above_max", image(guidance_scale=21.0), 400, ("guidance_scale",)),
    Case("true_cfg_scale_negative", image(true_cfg_scale=-1.0), 400, ("true_cfg_scale",)),
    Case("true_cfg_scale_above_max", image(true_cfg_scale=21.0), 400, ("true_cfg_scale",)),
    Case("layers_below_min", image(layers=1), 400, ("layers",)),
    Case("layers_above_max", image(layers=11), 400, ("layers",)),
    Case("seed_negative", image(seed=-1), 400, ("seed",)),
    Case("seed_above_uint32", image(seed=2**32), ACCEPTED, ("seed",)),  # seeds up to 2^63 - 1 on every route
    Case("output_format_invalid", image(output_format="gif"), 400, ("output_format",)),
    Case("vae_use_slicing_wrong_type", image(vae_use_slicing="wrong_type"), 400, ("vae_use_slicing",)),
    Case("user_wrong_type", image(user=123), 400, ("user",)),
    Case("negative_prompt_wrong_type", image(negative_prompt=["noise"]), 400, ("negative_prompt",)),
    Case("generator_device_wrong_type", image(generator_device=1), 400, ("generator_device",)),
    Case("lora_missing_required_fields", image(lora={"foo": "bar"}), 400, ("lora",)),
    # test_invalid_pid_params.py: vLLM-Omni's PiD decoding option, a field omni_serve does not have.
    Case("pid_decode_wrong_type", image(size="512x512", pid_decode="bad"), 400, ("pid_decode",)),
    Case("pid_decode_unknown_key", image(size="512x512", pid_decode={"extra": 1}), 400, ("pid_decode",)),
    Case(
        "pid_enabled_without_server_flag",
        image(size="512x512", pid_decode={"enabled": True, "scale": 4}),
        400,
        ("pid_decode",),
    ),
)


EDIT_MODEL = "tiny-qwen-image-edit"


def tiny_png(width: int = 32, height: int = 32) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color="gray").save(out, format="PNG")
    return out.getvalue()


def edit(with_image: bool = True, **form: str) -> dict[str, Any]:
    files = {"image": ("x.png", tiny_png(), "image/png")} if with_image else None
    # httpx sends a form without files url-encoded; the missing-image case sends a multipart body all the same.
    return {"files": files or {"prompt": (None, form.pop("prompt", ""))}, "data": form}


IMAGE_EDIT_CASES = (
    Case("missing_image", edit(False, prompt="make it brighter", model=EDIT_MODEL), 400, ("image",)),  # theirs: 422
    Case("model_mismatch", edit(prompt="edit", model="wrong-model-id"), 404, ("model",)),  # theirs: 400
    Case("unsupported_response_format", edit(prompt="edit", response_format="url"), 400, ("response_format",)),
    Case(
        "output_compression_above_max",
        edit(prompt="edit", model=EDIT_MODEL, output_compression="101"),
        400,
        ("output_compression",),
    ),
    Case("invalid_layers", edit(prompt="edit", model=EDIT_MODEL, layers="1"), 400, ("layers",)),
    # test_invalid_image_editing_cpu.py (theirs: 422 for the form's type errors)
    Case("seed_empty", edit(prompt="make it brighter", seed=""), 400, ("seed",)),
    Case("seed_not_int", edit(prompt="make it brighter", seed="abc"), 400, ("seed",)),
    Case("output_compression_not_int", edit(prompt="make it brighter", output_compression="abc"), 400, ("output",)),
    Case("missing_prompt", edit(), 400, ("prompt",)),
    Case("resolution_invalid", edit(prompt="make it brighter", resolution="512"), 400, ("resolution",)),
    Case(
        "resolution_with_explicit_size",
        edit(prompt="make it brighter", resolution="1024", size="1024x1024"),
        400,
        ("resolution",),
    ),
    Case("size_format", edit(prompt="make it brighter", size="abc"), 400, ("size",)),
    Case("size_non_positive", edit(prompt="make it brighter", size="0x1024"), 400, ("size",)),
)


VIDEO_PROMPT = {"prompt": "a cat walking on grass"}


def video_form(**form: str) -> dict[str, Any]:
    # OpenAI's client sends the create form as multipart, as vLLM-Omni's test client does.
    fields = {**VIDEO_PROMPT, **form}
    return {"files": {name: (None, value) for name, value in fields.items()}}


VIDEO_CASES = (
    Case("missing_prompt", {"files": {"seconds": (None, "4")}}, 400, ("prompt",)),  # theirs: an empty form
    Case("seconds_zero", video_form(seconds="0"), 400, ("seconds",)),
    Case("size_bad", video_form(size="bad"), 400, ("size",)),
    Case("num_inference_steps_zero", video_form(num_inference_steps="0"), 400, ("num_inference_steps",)),
    Case("num_inference_steps_above_max", video_form(num_inference_steps="201"), 400, ("num_inference_steps",)),
    Case("guidance_scale_above_max", video_form(guidance_scale="25"), 400, ("guidance_scale",)),
)


VIDEO_LIST_CASES = (
    Case("invalid_limit_negative", {"params": {"limit": -1}}, 400, ("limit",), method="GET"),
    Case("limit_above_max", {"params": {"limit": 101}}, 400, ("limit",), method="GET"),
    Case("invalid_order", {"params": {"order": "newest"}}, 400, ("order",), method="GET"),
)


VIDEO_MISSING = ("does-not-exist", 404)  # GET, DELETE /v1/videos/{id} and GET .../content: 404 naming the video
