"""Pure mapping between omni_serve and vLLM-Omni: sampling, prompts, and the multimodal outputs of a stage.

No engine here; everything is testable on CPU with tensors (tests/test_vllm_omni_handoffs.py).
vLLM and vLLM-Omni are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.media.inputs import Audio, Decoded, Video
from omni_serve.models import codec
from omni_serve.models.processor_media import processor_media
from omni_serve.types import SAMPLING_EXTENSIONS, FinishReason, SamplingParams


def vllm_sampling_params(sampling: SamplingParams, constraints: Mapping[str, Any], output_kind: Any) -> Any:
    """vLLM ``SamplingParams`` from omni_serve's, with the stage's constraints merged as vLLM-Omni does."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm_omni.config.stage_config import merge_sampling_constraints

    values = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # 0 disables top-k in vLLM as it does here
        "max_tokens": sampling.max_tokens,
        "repetition_penalty": sampling.repetition_penalty,
        "seed": sampling.seed,
        "stop": list(sampling.stop) or None,
        "stop_token_ids": list(sampling.stop_token_ids),
        # vLLM's own extra sampling parameters (ignore_eos, min_tokens, ...): vLLM-Omni's stages are vLLM engines.
        **{name: getattr(sampling, name) for name in SAMPLING_EXTENSIONS},
    }
    if sampling.structured_outputs is not None:
        from vllm.sampling_params import StructuredOutputsParams

        values["structured_outputs"] = StructuredOutputsParams(
            **sampling.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        )
    merged = merge_sampling_constraints(values, constraints)
    return VllmSamplingParams(**merged, output_kind=output_kind)


def multimodal_output(output: Any) -> dict[str, Any]:
    """The multimodal payload vLLM-Omni attached to a ``RequestOutput`` (request- or completion-level)."""
    for owner in (output, *(getattr(output, "outputs", None) or [])[:1]):
        value = getattr(owner, "multimodal_output", None)
        if isinstance(value, Mapping) and value:
            return dict(value)
    return {}


def _tensor(value: Any) -> Any:
    """One CPU tensor from a tensor or a list of per-step tensors."""
    import torch

    if isinstance(value, (list, tuple)):
        parts = [v for v in value if isinstance(v, torch.Tensor)]
        if not parts:
            return None
        value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return value.detach().cpu() if isinstance(value, torch.Tensor) else None


def audio_samples(mm: Mapping[str, Any]) -> tuple[np.ndarray, int]:
    """(float32 mono samples, sample rate) of a code2wav output."""
    import torch

    audio = _tensor(mm.get("audio", mm.get("model_outputs")))
    if audio is None:
        raise EngineError(f"code2wav output has no audio (keys: {sorted(mm)})")
    rate = mm.get("sr", codec.DEFAULT_SAMPLE_RATE)
    if isinstance(rate, (list, tuple)):
        rate = rate[-1] if rate else codec.DEFAULT_SAMPLE_RATE
    if isinstance(rate, torch.Tensor):
        rate = rate.reshape(-1)[-1].item()
    return audio.to(torch.float32).reshape(-1).numpy(), int(rate)


def finish_reason(reason: str | None) -> FinishReason:
    return {"length": FinishReason.LENGTH, "abort": FinishReason.ABORT}.get(reason or "stop", FinishReason.STOP)


def multimodal_prompt(text: str, media: list[Decoded], audio_rate: int) -> dict[str, Any]:
    """The prompt as vLLM-Omni hands it to the stage-0 input processor: the templated text, the media by
    modality in prompt order (``multi_modal_data``; audio as (samples, rate)), and the processor options."""
    kwargs = processor_media(media)
    videos = [m for m in media if isinstance(m, Video)]
    if kwargs.get("use_audio_in_video") and any(isinstance(m, Audio) for m in media):
        # vLLM pairs every audio item with a video under use_audio_in_video (Qwen3-Omni's
        # _derive_audio_from_video_placeholders raises otherwise); the transformers family takes both.
        raise InvalidStageInput(
            "mm_processor_kwargs.use_audio_in_video: this engine takes no audio parts beside videos with their "
            "own audio track",
            "mm_processor_kwargs.use_audio_in_video",
        )
    data: dict[str, Any] = {}
    if kwargs["images"]:
        data["image"] = kwargs["images"]
    if kwargs["audio"]:
        data["audio"] = [(samples, audio_rate) for samples in kwargs["audio"]]
    if kwargs["videos"]:
        data["video"] = kwargs["videos"]
    options = {k: kwargs[k] for k in ("fps", "use_audio_in_video") if videos}
    return {"prompt": text, "multi_modal_data": data, "mm_processor_kwargs": options}


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Prompt token ids of a chat: the template rendered as text, then encoded.

    Rendering to text first keeps this independent of what ``apply_chat_template(tokenize=True)``
    returns (a list in transformers 4, a ``BatchEncoding`` in 5, whose ``list()`` is its keys).
    The template writes the special tokens itself, so none are added.
    """
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja2 raises TemplateError for conversations the template refuses
        raise InvalidStageInput(f"messages: the model's chat template refused them: {err}") from None
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
