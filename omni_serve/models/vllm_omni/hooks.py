"""What a vLLM-Omni pipeline's declaration does not say, and omni_serve must know: per-model hooks.

Everything else about a ``vllm_omni`` stage comes from its ``StagePipelineConfig``
(:mod:`omni_serve.models.vllm_omni.pipelines`). A pipeline without hooks gets :data:`DEFAULT`; a
model module (e.g. :mod:`omni_serve.models.vllm_omni.qwen_omni`) registers hooks for the stages
where the declaration is not enough, each field with the reason. A lone image DiT (no pipeline around
it: its checkpoint's pipeline class) is served once its :class:`ImageDitHooks` are registered (e.g.
:mod:`omni_serve.models.vllm_omni.qwen_image`). docs/models.md lists every place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from omni_serve.models.image_params import ResolvedImageParams


@dataclass(frozen=True)
class StepRows:
    """How one stage's engine outputs map back onto the per-step outputs vLLM-Omni's runner hands its
    async-chunk processor (``async_chunk_process_next_stage_input_func``), one call per engine step.

    vLLM-Omni accumulates a stage's multimodal output per request: a value that gains rows as the
    request runs (one per position computed: the prompt's with the prefill step, then one a decoding
    step) comes as one tensor after the prefill, then a growing list of per-step tensors, then one
    consolidated tensor at the finish. ``rows`` names those values (dotted paths, a prefix covers
    what is under it); every other value is the same each step and is handed on as its first.
    """

    rows: tuple[str, ...] = ("codes.audio",)  # codec frames: what the TTS families' chunkers read


@dataclass(frozen=True)
class FrameGeometry:
    """How many codec ids one frame holds and how many samples a frame decodes to (generation stages
    that decode codec frames with left context: the replica cuts the context's samples)."""

    code_groups: int
    samples_per_frame: int


@dataclass(frozen=True)
class StageHooks:
    """The per-model facts of one stage (its ``model_stage`` in one pipeline). Defaults: none needed."""

    # The engine output rows a whole handoff's producer-side processor gets for these keys: only the
    # rows of generated positions, not the placeholder rows the engine holds for prompt positions.
    generated_rows_only: tuple[str, ...] = ()
    # Decoding steps this stage runs beyond the request's max_tokens (the last token's data comes a step later).
    extra_steps: int = 0
    step_rows: StepRows = field(default_factory=StepRows)
    # (payload, flat multimodal output, hf_config, tokens computed) -> None: corrects the payload the
    # producer-side processor built, in place, where it assumes what the engine here does not do.
    fix_payload: Callable[[Any, Mapping[str, Any], Any, int], None] | None = None
    # A stage that reads its upstream's async chunks: its placeholder prompt from the first chunk
    # (vLLM-Omni's prewarm sizes it per model), and the upstream's whole handoff as those chunks.
    chunk_prompt: Callable[[Any], dict[str, Any]] | None = None
    whole_as_chunks: Callable[[Any, Any], Any] | None = None
    # A chunk's payload as the stage's model reads it from its connector: (payload, model dtype) -> payload.
    chunk_payload: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
    # A producer whose async-chunk processor cuts chunks for a consumer that keeps decoder state per request
    # (after the first chunk only the new frames; an empty chunk ends that state): (its ChunkTransfer, a chunk
    # the processor made) -> the chunk as a stateless consumer call decodes it, or None where it carries
    # nothing to decode. Here each chunk is its own downstream call, on whichever replica takes it.
    stateless_chunk: Callable[[Any, Any], Any] | None = None
    # Generation stages decoding codec frames: the frame geometry from the checkpoint's config, and
    # whether to measure the samples a lone decode holds back (see engines.vllm_omni.generation).
    frame_geometry: Callable[[Any], FrameGeometry | None] | None = None
    measure_decode_lag: bool = False
    # Generation stages whose decoder cuts a prompt's left context (``meta.left_context_size``) itself when it
    # decodes without async-chunk state: the replica must not cut it again.
    decoder_cuts_left_context: bool = False
    # A speaking stage's voices (lower case) where its checkpoint's config lists none.
    speakers: tuple[str, ...] = ()


DEFAULT = StageHooks()


class SpeechPrompter(Protocol):
    """A TTS entry stage's prompts: :meth:`prompt` builds the engine prompt of one request (text to speak, voice,
    the speech fields) and changes the call's vLLM sampling params in place as the model's speech server does;
    a request the model refuses raises :class:`omni_serve.exceptions.InvalidStageInput` naming the field."""

    async def prompt(self, request: Any, params: Any) -> dict[str, Any]: ...

    def speakers(self) -> list[str]: ...


@dataclass(frozen=True)
class PipelineHooks:
    """Per-model hooks of one pipeline: by ``model_stage``, and what an entry stage needs."""

    stages: Mapping[str, StageHooks] = field(default_factory=dict)
    # A TTS entry stage (its graph's ``entry: speech``): (vllm_config, the stage's declaration, the engine's
    # collective RPC) -> its prompt builder, a :class:`SpeechPrompter`. vLLM-Omni builds these prompts per model
    # in its API server (entrypoints/openai/tts_adapters), not from the pipeline's declaration; a pipeline
    # opts in once its prompts are served and compared with native vLLM-Omni's.
    speech_prompt: Callable[[Any, Any, Any], SpeechPrompter] | None = None
    # vLLM's tool parser for the model's tool-call syntax (`vllm serve --tool-call-parser`): vLLM-Omni's
    # pipeline does not declare it; a generated graph's chat entry stage gets it (engine_args.tool_call_parser).
    tool_call_parser: str | None = None
    # An image entry stage (the graph's ``entry: image``, an AR stage planning for a DiT): what its sizes must
    # be multiples of. vLLM-Omni's AR processor rounds a target size down to its token grid silently (GLM-Image:
    # 32 pixels a token); omni_serve refuses what would be rounded (a 400 naming ``size``).
    image_size_multiple: int = 1
    # (height, width, editing) -> the tokens the AR stage writes for an image of that size: a size needing more
    # than the stage may decode (its max_tokens) is refused (a 400 naming ``size``), not left to fail the DiT.
    image_tokens: Callable[[int, int, bool], int] | None = None
    # The checkpoint a generated graph serves when the command names none (its --model).
    reference_model: str | None = None
    # OpenAI's voice names -> the model's speakers (closest timbre): a choice per model, declared nowhere upstream.
    voice_aliases: Mapping[str, str] = field(default_factory=dict)
    # Multi-node placement (cluster.yaml, deploy/kuberay.yaml): model_stage -> the marker resource of the node type
    # its replicas go to. The node types are sized per model; a pipeline without them places by GPUs alone.
    node_resources: Mapping[str, str] = field(default_factory=dict)

    def stage(self, model_stage: str) -> StageHooks:
        return self.stages.get(model_stage, DEFAULT)


@dataclass(frozen=True)
class VideoDitHooks:
    """A lone video DiT's facts that no declaration says: how its checkpoint sizes a video (vLLM-Omni's
    ``/v1/videos`` mapping of the request is one for every video pipeline)."""

    # The checkpoint directory -> (pixel size multiple, frame count multiple): what its pipeline rounds sizes and
    # frame counts to (omni_serve refuses others with a 400 instead).
    multiples: Callable[[str], tuple[int, int]]
    # The pipeline animates an image (HunyuanVideo-1.5's image-to-video class): every request carries one input image
    # (vLLM-Omni's /v1/videos ``input_reference``), sent as the prompt's ``multi_modal_data["image"]``;
    # ``engine_args.image_input`` must say so.
    image_to_video: bool = False


@dataclass(frozen=True)
class ImageDitHooks:
    """A lone image DiT's request mapping: what vLLM-Omni's images API does for its pipeline class (the checkpoint's
    ``model_index.json`` ``_class_name``) and no declaration says."""

    # Pixel sizes must be multiples of this (its VAE's downsampling times its latent patch): vLLM-Omni rounds other
    # sizes down silently, omni_serve refuses them (a 400 naming ``size``).
    size_multiple: int
    # (prompt, the request's resolved image parameters) -> (``OmniTextPrompt`` fields,
    # ``OmniDiffusionSamplingParams`` fields): how the pipeline reads guidance, the negative prompt, the seed.
    request_fields: Callable[[str, ResolvedImageParams], tuple[dict[str, Any], dict[str, Any]]]
    # The pipeline edits: every request carries one source image (``engine_args.image_input`` must say so).
    edits: bool = False
