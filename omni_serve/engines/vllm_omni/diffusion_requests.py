"""A DiT stage's requests: one mapping per kind of stage, chosen once at start (:func:`requests_for`).

- :class:`ImageRequests`: a lone image DiT, through its pipeline class's hooks (``ImageDitHooks``; Qwen-Image:
  :mod:`omni_serve.models.vllm_omni.qwen_image`), an editing pipeline's source image decoded by the stage;
- :class:`VideoRequests`: a lone video DiT, through its pipeline class's hooks (``VideoDitHooks``: how its
  checkpoint sizes a video, whether it animates an image; Wan 2.2: :mod:`omni_serve.models.vllm_omni.wan`,
  HunyuanVideo-1.5: :mod:`omni_serve.models.vllm_omni.hunyuan_video`), as vLLM-Omni's ``/v1/videos`` maps its form
  (an image-to-video pipeline's image as the prompt's ``multi_modal_data``); the frames it returns become an MP4 in
  the replica;
- :class:`PipelineRequests`: the DiT stage of a vLLM-Omni pipeline (GLM-Image), its request built from its
  upstream's handoff by the stage's declared input processor.

Each turns one :class:`~omni_serve.types.StageRequest` into a :class:`Planned` engine request (``plan``) and the
engine's finished outputs into the stage's final :class:`~omni_serve.types.StageOutput` (``reply``). A new lone
DiT is a hook (a pipeline class in ``pipelines.IMAGE_DITS`` or ``pipelines.VIDEO_DITS``), not a branch here; a
lone DiT may be a vLLM-Omni pipeline's only stage (``pipeline``, ``stage_id``: a generated graph) or a checkpoint
alone.

Video requests (:func:`video_request_fields`, pure) map :class:`~omni_serve.types.VideoParams`: size ->
``width``/``height``, ``num_frames``, steps, ``guidance_scale`` (classifier-free guidance, a negative prompt sent
whenever given), ``seed`` on a CPU generator. Sizes must be multiples of the VAE's spatial factor times the
transformer's patch and frame counts of the VAE's temporal factor plus one (both read from the checkpoint's configs
at start by its hook; Wan 2.2 TI2V: 32 and 4k + 1); vLLM-Omni rounds others down, here they are
rejected (:mod:`omni_serve.models.video_params`). The frames vLLM-Omni returns ([0, 1] floats) become uint8 as its
server rounds them and are encoded to MP4 (:func:`omni_serve.media.encode.encode_mp4`: H.264 at vLLM-Omni's
settings, so the same frames make the same file); the file leaves the replica as its own stream item
(:mod:`omni_serve.graph.transport`), never inside the output.

Requests of a pipeline's DiT stage: the stage's declared input processor (``ar2diffusion``) makes the diffusion
prompt from the upstream AR's handoff and the request's prompt it carries
(:func:`omni_serve.models.vllm_omni.edges.diffusion_input`): prior token ids, the size, the image to edit; the
request's steps and guidance (or the stage's defaults) and the AR's seed go to the sampling params, as vLLM-Omni's
multistage image request sets them (one image per request).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

import numpy as np

from omni_serve.engines.vllm_omni.diffusion_args import SIZE_MULTIPLE, EngineArgs
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.media.encode import encode_mp4
from omni_serve.models import image_params, video_params
from omni_serve.models.image_params import prompt_of
from omni_serve.models.vllm_omni.hooks import ImageDitHooks
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, ImageParams, StageOutput, StageRequest, VideoParams, VideoRules

IMAGE, VIDEO = "image", "video"  # vLLM-Omni's final output types the DiT stages serve


@dataclasses.dataclass
class Planned:
    """One engine request: the ``OmniTextPrompt`` (or a processor's diffusion prompt) fields, the
    ``OmniDiffusionSamplingParams`` fields, and how many outputs the engine must return."""

    prompt: dict[str, Any]
    sampling: dict[str, Any]
    expected: int = 1
    video: VideoParams | None = None  # a video request's resolved parameters (the reply checks and encodes)


class Requests(Protocol):
    """A kind of DiT stage's request mapping (see the module's docstring)."""

    @property
    def video_rules(self) -> VideoRules | None:
        """A video stage's defaults and limits (the videos API reads them); None for image stages."""

    def plan(self, request: StageRequest, handoff: HandoffPayload | None) -> Planned: ...

    def outputs(self, images: list[Any]) -> list[Any]:
        """The request's outputs in a finished engine output's ``images`` (one per image, or per video)."""

    async def reply(self, planned: Planned, outputs: list[Any]) -> StageOutput: ...


def source_image(stage_name: str, request: StageRequest, takes_image: bool, does: str) -> np.ndarray | None:
    """The one source image of a stage that takes one (decoded by the stage from the request's image part: the image
    an editing pipeline edits, ``does`` "edits", or an image-to-video pipeline animates); None for the others."""
    from omni_serve.media.inputs import Image

    media = request.media or []
    if not takes_image:
        if media:
            raise InvalidStageInput(f"messages: stage {stage_name} takes no images", param="messages")
        return None
    images = [item.pixels for item in media if isinstance(item, Image)]
    if len(images) != 1 or len(media) != 1:
        raise InvalidStageInput(
            f"image: stage {stage_name} {does} exactly one image per request (got {len(media)} media item(s))",
            param="image",
        )
    return images[0]


def image_arrays(images: list[Any]) -> list[np.ndarray]:
    """uint8 HxWx3 arrays from the PIL images vLLM-Omni's image post-processing returns."""
    return [np.ascontiguousarray(np.asarray(image.convert("RGB"), dtype=np.uint8)) for image in images]


def images_output(stage_name: str, outputs: list[Any]) -> StageOutput:
    """An image stage's final output: the engine's images as arrays."""
    return StageOutput(stage=stage_name, images=image_arrays(outputs), finished=True, finish_reason=FinishReason.STOP)


@dataclasses.dataclass
class ImageRequests:
    """A lone image DiT's requests, mapped by its pipeline class's hooks."""

    stage_name: str
    args: EngineArgs
    hooks: ImageDitHooks
    video_rules: VideoRules | None = None

    def params(self, request: StageRequest) -> image_params.ResolvedImageParams:
        """The request's image parameters (or the stage defaults), checked; the seed always set."""
        return image_params.resolve_image_params(request, self.args, self.hooks.size_multiple)

    def plan(self, request: StageRequest, handoff: HandoffPayload | None) -> Planned:
        if request.video is not None:
            raise InvalidStageInput(f"model: stage {self.stage_name} makes images, not videos", param="model")
        source = self._source_image(request)
        if source is not None and request.image is not None and not request.image.width:  # size "auto"
            height, width = source.shape[:2]
            width, height = image_params.fitted_size(width, height, self.hooks.size_multiple, self.args.max_pixels)
            request.image = request.image.model_copy(update={"width": width, "height": height})
        params = self.params(request)
        text_prompt, sampling = self.hooks.request_fields(prompt_of(request), params)
        if source is not None:
            from PIL import Image

            text_prompt["multi_modal_data"] = {"image": Image.fromarray(source)}
        return Planned(text_prompt, sampling, expected=params.n)

    def outputs(self, images: list[Any]) -> list[Any]:
        return list(images)

    async def reply(self, planned: Planned, outputs: list[Any]) -> StageOutput:
        return images_output(self.stage_name, outputs)

    def _source_image(self, request: StageRequest) -> np.ndarray | None:
        return source_image(self.stage_name, request, self.args.image_input, "edits")


@dataclasses.dataclass
class PipelineRequests:
    """The DiT stage of a vLLM-Omni pipeline: each request from its upstream's handoff (one image a request)."""

    stage_name: str
    args: EngineArgs
    declared: Any  # the stage's StagePipelineConfig
    video_rules: VideoRules | None = None

    def plan(self, request: StageRequest, handoff: HandoffPayload | None) -> Planned:
        """The diffusion prompt by the stage's declared input processor from the upstream output and the request's
        entry prompt (:func:`omni_serve.models.vllm_omni.edges.diffusion_input`); the size it decided, the request's
        steps and guidance (or the stage's defaults: the deploy config's), and the seed the upstream stage ran with."""
        from omni_serve.models.vllm_omni.edges import diffusion_input

        assert handoff is not None  # the engine checks that a pipeline's stage gets one
        try:
            prompt = diffusion_input(self.declared, [handoff], request_id=request.request_id)
        except ValueError as err:  # the upstream output does not parse (e.g. too few tokens for the size)
            raise EngineError(f"stage {self.stage_name}: {err}") from None
        # The size ar2diffusion decided and the seed the AR ran with, checked against this stage's limits as any
        # image request is (steps and guidance: the request's, or the stage's defaults).
        given = (request.image or ImageParams(width=0, height=0)).model_copy(
            update={"width": int(prompt["width"]), "height": int(prompt["height"]), "seed": handoff.meta.get("seed")}
        )
        params = image_params.resolve_image_params(dataclasses.replace(request, image=given), self.args, SIZE_MULTIPLE)
        sampling = {
            "width": params.width,
            "height": params.height,
            "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale,
            "num_outputs_per_prompt": 1,
            "seed": params.seed % image_params.SEED_MOD,
            "emit_request_lifecycle": True,
        }
        return Planned(prompt, sampling)

    def outputs(self, images: list[Any]) -> list[Any]:
        return list(images)

    async def reply(self, planned: Planned, outputs: list[Any]) -> StageOutput:
        return images_output(self.stage_name, outputs)


def video_request_fields(prompt: str, params: VideoParams) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``OmniTextPrompt`` fields, ``OmniDiffusionSamplingParams`` fields) for one video request, as vLLM-Omni's
    ``/v1/videos`` builds them from the same values (``serving_video.py``); fps only times the MP4."""
    text_prompt: dict[str, Any] = {"prompt": prompt}
    if params.negative_prompt is not None:
        text_prompt["negative_prompt"] = params.negative_prompt
    sampling = {
        "width": params.width,
        "height": params.height,
        "num_frames": params.num_frames,
        "num_inference_steps": params.num_inference_steps,
        "guidance_scale": params.guidance_scale,
        "num_outputs_per_prompt": 1,
        "seed": (params.seed or 0) % image_params.SEED_MOD,
        "generator_device": "cpu",
        "emit_request_lifecycle": True,
    }
    return text_prompt, sampling


def videos_of(images: list[Any]) -> list[Any]:
    """The videos in a finished engine output's ``images``, as vLLM-Omni's ``/v1/videos`` reads them
    (``OmniOpenAIServingVideo._normalize_video_outputs``): one array per video (T, H, W, 3), batches of them
    ([B,] T, H, W, 3: Wan 2.2's), or one video as its frames (PIL images or H, W, 3 arrays: HunyuanVideo-1.5's
    post-processing returns PIL frames), stacked into one array."""
    if not images:
        return []
    ndim = getattr(images[0], "ndim", None)
    if ndim == 5:
        return [video[i] for video in images for i in range(video.shape[0])]
    if ndim is None or ndim == 3:
        return [np.stack([np.asarray(frame) for frame in images])]
    return list(images)


def video_frames(video: Any) -> np.ndarray:
    """uint8 frames [T, H, W, 3] of one video as vLLM-Omni's pipelines return it ([1,] T, H, W, 3 floats in
    [0, 1]), rounded as vLLM-Omni's server rounds them before it encodes (clip, x 255, round half to even,
    ``video_api_utils._PlanarFrameConverter``)."""
    frames = np.asarray(video)
    if frames.ndim == 5 and frames.shape[0] == 1:
        frames = frames[0]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise EngineError(f"expected video frames [T, H, W, 3], got shape {frames.shape}")
    if frames.dtype == np.uint8:
        return np.ascontiguousarray(frames)
    # In the frames' own float type, as vLLM-Omni's server does: float64 rounds some x.5 values the other
    # way, and one changed input value changes what H.264 makes of a whole block.
    scaled = np.clip(frames, 0.0, 1.0)
    scaled *= 255.0
    return np.rint(scaled).astype(np.uint8)


@dataclasses.dataclass
class VideoRequests:
    """A lone video DiT's requests: vLLM-Omni's ``/v1/videos`` mapping; the frames it returns, as an MP4."""

    stage_name: str
    video_rules: VideoRules
    image_to_video: bool = False  # each request carries the one image its pipeline animates (VideoDitHooks)

    def plan(self, request: StageRequest, handoff: HandoffPayload | None) -> Planned:
        if request.image is not None:
            raise InvalidStageInput(f"model: stage {self.stage_name} makes videos, not images", param="model")
        source = source_image(self.stage_name, request, self.image_to_video, "animates")
        video = video_params.resolve_video_params(request, self.video_rules)
        text_prompt, sampling = video_request_fields(prompt_of(request), video)
        if source is not None:  # as vLLM-Omni's /v1/videos passes input_reference
            from PIL import Image

            text_prompt["multi_modal_data"] = {"image": Image.fromarray(source)}
        return Planned(text_prompt, sampling, video=video)

    def outputs(self, images: list[Any]) -> list[Any]:
        return videos_of(images)

    async def reply(self, planned: Planned, outputs: list[Any]) -> StageOutput:
        video = planned.video
        assert video is not None
        frames = video_frames(outputs[0])
        if frames.shape[:3] != (video.num_frames, video.height, video.width):
            raise EngineError(
                f"stage {self.stage_name}: the pipeline made frames of shape {frames.shape[:3]}, asked "
                f"{(video.num_frames, video.height, video.width)}"
            )
        mp4 = await asyncio.to_thread(encode_mp4, frames, video.fps)  # CPU work, off the replica's event loop
        return StageOutput(
            stage=self.stage_name,
            video=np.frombuffer(mp4, dtype=np.uint8),
            progress=1.0,
            finished=True,
            finish_reason=FinishReason.STOP,
        )


def requests_for(stage_name: str, args: EngineArgs, class_name: str, output_type: str, model_path: str) -> Requests:
    """The request mapping of a stage whose checkpoint has pipeline class ``class_name``, which vLLM-Omni declares to
    make ``output_type`` (``get_diffusion_output_type``); ``model_path``: the resolved checkpoint (blocking: it may
    read configs from the hub). A pipeline's DiT stage fed by an upstream takes its requests from the handoff; a
    lone DiT (a pipeline's only stage, or a checkpoint alone) from the client, mapped by its class's hooks."""
    if args.pipeline is not None:
        declared = declaration(stage_name, args, class_name, output_type)
        if declared.input_sources:
            return PipelineRequests(stage_name, args, declared)
    from omni_serve.models.vllm_omni import pipelines

    image = pipelines.IMAGE_DITS.get(class_name) if output_type == IMAGE else None
    video = pipelines.VIDEO_DITS.get(class_name) if output_type == VIDEO else None
    if image is None and video is None:
        raise EngineError(
            f"stage {stage_name}: {args.model} is a {class_name!r} checkpoint (vLLM-Omni: {output_type}); this "
            f"family serves the image pipelines {sorted(pipelines.IMAGE_DITS)} and the video pipelines "
            f"{sorted(pipelines.VIDEO_DITS)}"
        )
    takes_image = image.edits if image is not None else video is not None and video.image_to_video
    if args.image_input != takes_image:
        raise EngineError(
            f"stage {stage_name}: {args.model} is a {class_name!r} checkpoint: set image_input: "
            f"{str(takes_image).lower()} (requests to an editing or image-to-video pipeline carry their image)"
        )
    if video is not None:
        multiples = video.multiples(_local_checkpoint(model_path, args.revision))
        rules = video_params.rules(args, *multiples, takes_image=video.image_to_video)
        return VideoRequests(stage_name, rules, video.image_to_video)
    assert image is not None
    for name in ("default_width", "default_height"):
        if getattr(args, name) % image.size_multiple:
            raise EngineError(f"stage {stage_name}: {name}: must be a multiple of {image.size_multiple}")
    return ImageRequests(stage_name, args, image)


def declaration(stage_name: str, args: EngineArgs, class_name: str, output_type: str) -> Any:
    """A pipeline's DiT stage's declaration (``StagePipelineConfig``), checked against the checkpoint."""
    from omni_serve.models.vllm_omni import pipelines

    assert args.pipeline is not None and args.stage_id is not None  # EngineArgs checks both
    try:
        declared = pipelines.stage(args.pipeline, args.stage_id)
    except KeyError as err:
        raise EngineError(f"stage {stage_name}: {err.args[0]}") from None
    where = f"stage {stage_name}: pipeline {args.pipeline!r} stage {args.stage_id}"
    if pipelines.family(declared) != "vllm_omni_diffusion":
        raise EngineError(f"{where} ({declared.model_stage}) is not a DiT stage")
    if declared.input_sources and (declared.final_output_type != IMAGE or output_type != IMAGE):
        raise EngineError(f"{where} makes {declared.final_output_type!r}; this family's pipeline stages draw images")
    if declared.final_output_type != output_type:
        raise EngineError(f"{where} makes {declared.final_output_type!r}; {args.model} makes {output_type!r}")
    if declared.model_arch and declared.model_arch != class_name:
        raise EngineError(f"{where} runs {declared.model_arch}; {args.model} is a {class_name!r} checkpoint")
    return declared


def _local_checkpoint(model: str, revision: str | None) -> str:
    """A directory with the checkpoint's config files: ``model`` itself, or the hub's cached snapshot of them."""
    import os

    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, allow_patterns=["*/config.json", "model_index.json"])
