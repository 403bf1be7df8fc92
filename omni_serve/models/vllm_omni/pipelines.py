"""vLLM-Omni's pipeline declarations, read from its registry, and what omni_serve makes of them.

vLLM-Omni describes every model it serves as data: ``OMNI_PIPELINES`` maps a model type to a
``PipelineConfig`` (or a resolver that picks one from the checkpoint's config), whose
``StagePipelineConfig`` stages declare their execution type, inputs, final output, input processors
and sampling constraints. A ``vllm_omni`` stage is built from its stage's declaration here; what the
declaration does not say comes from per-model hooks (:func:`hooks`), listed in docs/models.md.

Heavy: the registry imports vLLM and every pipeline module (a minute and 0.5 GiB on a loaded 2-core
machine). Stage replicas and the graph generator import this module; graph validation in the ingress
never does (it reads only the graph file).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from omni_serve.models.vllm_omni import (
    glm_image,
    hunyuan_video,
    ming_flash_omni,
    qwen3_tts,
    qwen_image,
    qwen_omni,
    voxtral_tts,
    wan,
)
from omni_serve.models.vllm_omni.hooks import ImageDitHooks, PipelineHooks, VideoDitHooks

# Per-model hooks, by pipeline (model type). A pipeline not listed needs none.
HOOKS: dict[str, PipelineHooks] = {
    "qwen3_omni_moe": qwen_omni.QWEN3_OMNI,
    "qwen2_5_omni": qwen_omni.QWEN2_5_OMNI,
    "qwen3_tts": qwen3_tts.QWEN3_TTS,
    "voxtral_tts": voxtral_tts.VOXTRAL_TTS,
    "ming_flash_omni_tts": ming_flash_omni.MING_FLASH_OMNI_TTS,
    "glm_image": glm_image.GLM_IMAGE,
    "wan2_2_ti2v": wan.WAN2_2_TI2V,
    "hunyuan_video_15": hunyuan_video.HUNYUAN_VIDEO_15_PIPELINE,
}
# Lone DiTs (no stage before them), by their checkpoint's pipeline class (model_index.json ``_class_name``, a
# declaration's model_arch): the ones whose request mapping omni_serve implements. An image DiT's mapping is per
# pipeline class (vLLM-Omni's images server); a video DiT's is vLLM-Omni's one /v1/videos mapping, given how its
# checkpoint sizes a video.
IMAGE_DITS: dict[str, ImageDitHooks] = {
    "QwenImagePipeline": qwen_image.QWEN_IMAGE,
    "QwenImageEditPipeline": qwen_image.QWEN_IMAGE_EDIT,
}
VIDEO_DITS: dict[str, VideoDitHooks] = {
    "WanPipeline": wan.WAN,
    "HunyuanVideo15Pipeline": hunyuan_video.HUNYUAN_VIDEO_15,
    "HunyuanVideo15ImageToVideoPipeline": hunyuan_video.HUNYUAN_VIDEO_15_I2V,
}

# The execution types omni_serve's vllm_omni family runs, and the engine kind for each.
KINDS = {"llm_ar": "autoregressive", "llm_generation": "generation"}
# DiT stages run on vLLM-Omni's DiffusionEngine: the vllm_omni_diffusion family.
DIFFUSION = "diffusion"


def hooks(pipeline: str) -> PipelineHooks:
    return HOOKS.get(pipeline, PipelineHooks())


def registry() -> dict[str, Any]:
    """vLLM-Omni's ``OMNI_PIPELINES``: model type -> ``PipelineConfig`` or resolver."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES

    return OMNI_PIPELINES


def pipeline(model_type: str) -> Any:
    """The ``PipelineConfig`` registered for ``model_type``.

    A resolver picks a variant from the checkpoint's HF config (Qwen3-Omni: thinker-only when the
    checkpoint has no audio output); without a checkpoint, the pipeline its module declares for this
    model type (the full one) is taken.
    """
    from vllm_omni.config.stage_config import PipelineConfig

    entries = registry()
    if model_type not in entries:
        raise KeyError(f"no vLLM-Omni pipeline {model_type!r} (registered: {len(entries)}, e.g. {sorted(entries)[:5]})")
    entry = entries[model_type]
    if isinstance(entry, PipelineConfig):
        return entry
    declared = [v for v in vars(sys.modules[entry.__module__]).values() if isinstance(v, PipelineConfig)]
    for candidate in declared:
        if candidate.model_type == model_type:
            return candidate
    raise KeyError(f"the resolver of pipeline {model_type!r} declares no pipeline of that model type in its module")


def stage(model_type: str, stage_id: int) -> Any:
    """One ``StagePipelineConfig`` of a pipeline."""
    found = pipeline(model_type).get_stage(stage_id)
    if found is None:
        ids = [s.stage_id for s in pipeline(model_type).stages]
        raise KeyError(f"pipeline {model_type!r} has no stage {stage_id} (stages: {ids})")
    return found


def kind(stage: Any) -> str | None:
    """The engine kind that runs a stage (``autoregressive``, ``generation``), None for those it does not."""
    return KINDS.get(_execution(stage))


def _execution(stage: Any) -> str:
    return str(getattr(stage.execution_type, "value", stage.execution_type))


def family(stage: Any) -> str:
    """The omni_serve engine family of a stage: ``vllm_omni_diffusion`` for a DiT stage, else ``vllm_omni``."""
    return "vllm_omni_diffusion" if _execution(stage) == DIFFUSION else "vllm_omni"


def entry_prompt(declared: Any) -> str:
    """What the pipeline's entry stage builds its prompt from: ``speech`` (the text to speak) when the pipeline
    answers audio and no text (a TTS model: vLLM-Omni serves these on its speech API), ``image`` (an image
    request: prompt, size, seed, a source image to edit) when it answers images only (vLLM-Omni's images API),
    else ``chat``."""
    finals = {s.final_output_type for s in declared.stages if s.final_output}
    if finals == {"image"}:
        return "image"
    return "speech" if "audio" in finals and "text" not in finals else "chat"


MEDIA = ("image", "audio", "video")


def entry_media(declared: Any) -> list[str]:
    """The media a pipeline's entry stage takes in a chat message: none unless it declares multimodal input;
    then those its model class has a prompt placeholder for (``SupportsMultiModal.get_placeholder_str``: vLLM's
    class for the architecture, else vLLM-Omni's), all three where no class says."""
    from vllm import ModelRegistry
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    entry = next(s for s in declared.stages if not s.input_sources)
    if not entry.requires_multimodal_data:
        return []
    arch = entry.model_arch or declared.model_arch
    registry_log = logging.getLogger("vllm.model_executor.models.registry")
    level, registry_log.level = registry_log.level, logging.CRITICAL  # a class that fails to import logs a traceback
    try:
        for registry in (ModelRegistry, OmniModelRegistry):
            try:  # a class that fails to import here (a missing optional dependency) says nothing
                model_class = registry._try_load_model_cls(arch) if arch else None
            except Exception:
                model_class = None
            taken = [m for m in MEDIA if _placeholder(model_class, m)]
            if taken:
                return taken
    finally:
        registry_log.level = level
    return list(MEDIA)


def _placeholder(model_class: Any, modality: str) -> bool:
    try:
        return model_class.get_placeholder_str(modality, 0) is not None
    except Exception:  # no such method, or vLLM's ValueError for a modality the model does not take
        return False


def speakers(hf_config: Any) -> list[str]:
    """The speaker names a checkpoint's config lists (lower case), where vLLM-Omni's speech API reads them
    (``load_supported_speakers``: ``talker_config.spk_id`` / ``speaker_id``)."""
    config = getattr(hf_config, "talker_config", None)
    for attr in ("spk_id", "speaker_id"):
        names = config.get(attr) if isinstance(config, dict) else getattr(config, attr, None)
        if isinstance(names, dict) and names:
            return sorted(str(name).lower() for name in names)
    return []
