"""An entry stage's prompt, from what a request carries: chat messages (and media), or the text to speak.

- **Chat** (``entry: chat``): the checkpoint's chat template over the messages; with media, vLLM-Omni's
  stage-0 input processor (``build_stage0_input_processor``: the checkpoint's HF processor, placeholders
  expanded) on a thread of its own, as vLLM-Omni builds it for its entry stage.
- **Text to speak on a chat entry** (``/v1/audio/speech`` on a speech-to-speech graph): the text is
  teacher-forced as the assistant's reply, followed by the template's end-of-turn token: one prefill
  over the prompt and the reply, so the downstream stages get the states of exactly that text
  (:meth:`EntryPrompts.spoken`).
- **Text to speak on a TTS entry** (``entry: speech``): the model's own prompt, which vLLM-Omni builds
  per model in its API server (its TTS adapters); a pipeline's hook here (``speech_prompt``,
  :mod:`omni_serve.models.vllm_omni.hooks`) builds it.
- **An image request** (``entry: image``, an AR stage planning for a DiT): the prompt vLLM-Omni's images
  API builds for any AR -> DiT pipeline (:meth:`EntryPrompts.image`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from omni_serve.engines.vllm_omni.mapping import chat_prompt_ids, multimodal_prompt
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.models.chat_template import template_messages
from omni_serve.models.vllm_omni.hooks import PipelineHooks, SpeechPrompter
from omni_serve.types import StageRequest

logger = logging.getLogger("ray.serve")


class EntryPrompts:
    """The prompts of one entry stage's requests; :meth:`start` once the engine runs."""

    def __init__(
        self,
        stage_name: str,
        pipeline: str,
        hooks: PipelineHooks,
        media: bool,
        declared: Any = None,
        entry: str = "chat",
    ):
        self.stage_name = stage_name
        self.declared_entry = entry  # engine_args.entry: what the stage's requests carry
        self.declared = declared  # the stage's StagePipelineConfig (a TTS prompt builder reads its tts_args)
        self.pipeline = pipeline
        self.hooks = hooks
        self.media = media  # the graph lets messages carry media to this stage
        self.tokenizer: Any = None
        self.hf_config: Any = None
        self.audio_input_rate = 16000  # Whisper's, unless the processor says otherwise
        self._input_processor: Any = None  # vLLM's input processor for prompts with media
        self._media_thread: Any = None
        self._speech: SpeechPrompter | None = None

    def start(self, vllm_config: Any, tokenizer: Any, rpc: Any) -> None:
        """Once the engine runs: ``rpc`` is its collective RPC (a TTS adapter asks the workers about the model)."""
        self.tokenizer = tokenizer
        self.hf_config = vllm_config.model_config.hf_config
        if (self.media or self.declared_entry == "image") and tokenizer is not None:
            self._start_media_input(vllm_config)
        if self.hooks.speech_prompt is not None:
            self._speech = self.hooks.speech_prompt(vllm_config, self.declared, rpc)

    def speakers(self) -> list[str]:
        """The voices a TTS entry stage's prompt builder knows (lower case; none without one)."""
        return self._speech.speakers() if self._speech is not None else []

    def shutdown(self) -> None:
        if self._media_thread is not None:
            self._media_thread.shutdown(wait=False, cancel_futures=True)

    def _start_media_input(self, vllm_config: Any) -> None:
        """The stage-0 input processor vLLM-Omni builds for its entry stage: it runs the checkpoint's HF
        processor on a prompt's media and expands the placeholders. It runs on one thread of its own
        (the HF processor is CPU-bound; vLLM's processor cache is not shared between threads)."""
        from concurrent.futures import ThreadPoolExecutor

        from vllm_omni.engine.stage_init_utils import build_stage0_input_processor

        self._input_processor = build_stage0_input_processor(vllm_config)
        self._media_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.stage_name}-media")
        try:
            info = self._input_processor.renderer.mm_processor.info
            self.audio_input_rate = int(info.get_feature_extractor().sampling_rate)
        except Exception as err:  # a pipeline without a feature extractor: Whisper's rate
            logger.info("stage %s: audio input rate from the processor unavailable (%s)", self.stage_name, err)

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise EngineError(f"stage {self.stage_name}: an entry stage needs its tokenizer (skip_tokenizer_init set)")
        return self.tokenizer

    async def chat(self, request: StageRequest, params: Any) -> tuple[list[int], Any]:
        """Prompt ids of the request's messages, and the media features for the EngineCore (None without media)."""
        if not request.messages:
            raise InvalidStageInput(f"stage {self.stage_name}: the entry stage needs messages")
        tokenizer = self._tokenizer()
        turns = template_messages(request.messages)
        tools = request.tools.tools if request.tools else None  # the template writes them into the prompt
        if not request.media:
            return chat_prompt_ids(tokenizer, turns, tools), None
        if self._input_processor is None:
            raise EngineError(f"stage {self.stage_name}: takes no media (the graph's engine_args.media)")
        try:
            text = tokenizer.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # jinja2 raises TemplateError for conversations the template refuses
            raise InvalidStageInput(f"messages: the model's chat template refused them: {err}") from None
        prompt = multimodal_prompt(text, request.media or [], self.audio_input_rate)
        loop = asyncio.get_running_loop()
        try:
            processed = await loop.run_in_executor(
                self._media_thread,
                lambda: self._input_processor.process_inputs(
                    request.request_id, prompt, params, supported_tasks=("generate",)
                ),
            )
        except ValueError as err:  # vLLM's input validation (e.g. a prompt over max_model_len)
            raise InvalidStageInput(f"messages: {err}", "messages") from None
        return [int(i) for i in processed.prompt_token_ids], processed.mm_features

    async def image(self, request: StageRequest, params: Any) -> tuple[list[int], Any, dict[str, Any]]:
        """An image request's prompt, as vLLM-Omni's images API builds one for an AR -> DiT pipeline
        (``OmniOpenAIServingChat._build_multistage_generation_inputs``): the prompt's text; ``modalities``
        ``image``, or ``img2img`` with the image to edit in ``multi_modal_data``; the target size (and, editing,
        the seed of the source image's encoding) in ``mm_processor_kwargs``; run through vLLM's input processor,
        whose model processor adds its generation scaffold. ``params`` (the call's vLLM sampling params) get the
        request's seed and the target size in ``extra_args`` (the model's M-RoPE positions of what it generates).

        Returns the prompt ids, the media features and the prompt, which the DiT stage's input processor reads
        as the request's (``edges.with_entry_prompt``). The seed is the request's, drawn here when it has none:
        the DiT draws with the same one (``params.seed``), as native's API sends one seed to both stages.
        """
        from PIL import Image as PILImage

        from omni_serve.media.inputs import Image
        from omni_serve.models.image_params import SEED_MOD, prompt_of

        image = request.image
        if image is None:
            raise InvalidStageInput(
                f"stage {self.stage_name} draws images: use /v1/images/generations or /v1/images/edits", "model"
            )
        if image.n != 1:  # the AR -> DiT processor builds one DiT request per AR output
            raise InvalidStageInput(f"n: this model draws one image per request (got {image.n})", "n")
        sources = [item.pixels for item in request.media or [] if isinstance(item, Image)]
        if len(sources) != len(request.media or []) or len(sources) > 1:
            raise InvalidStageInput(f"image: stage {self.stage_name} edits one image per request", "image")
        width, height = image.width, image.height
        if not width and sources:  # size "auto": the source image's
            height, width = sources[0].shape[:2]
        multiple = self.hooks.image_size_multiple
        if width < multiple or height < multiple or width % multiple or height % multiple:
            raise InvalidStageInput(
                f"size: width and height must be positive multiples of {multiple} (got {width}x{height})", "size"
            )
        needed = self.hooks.image_tokens(height, width, bool(sources)) if self.hooks.image_tokens else 0
        if params.max_tokens is not None and needed > params.max_tokens:
            raise InvalidStageInput(
                f"size: {width}x{height} takes {needed} tokens of stage {self.stage_name}, which writes at most "
                f"{params.max_tokens} (its max_tokens)",
                "size",
            )
        seed = image.seed if image.seed is not None else secrets.randbelow(SEED_MOD)
        prompt: dict[str, Any] = {"prompt": prompt_of(request), "modalities": ["img2img" if sources else "image"]}
        if image.negative_prompt is not None:
            prompt["negative_prompt"] = image.negative_prompt
        prompt["mm_processor_kwargs"] = {"target_h": height, "target_w": width}
        if sources:
            prompt["mm_processor_kwargs"]["vae_generator_seed"] = seed
            prompt["multi_modal_data"] = {"img2img": PILImage.fromarray(sources[0])}
            # The image's uuid, as native's chat route sends it: vLLM's renderer checks each key of the prompt's
            # multi_modal_data against the items the model's parser made of them, and GLM-Image's parser files
            # img2img under image, so without one vLLM refuses the request ("multi_modal_data['img2img'] is empty
            # but multi_modal_uuids['img2img'] is missing"; native's /v1/images/edits fails so). No upstream
            # issue found.
            prompt["multi_modal_uuids"] = {"img2img": [f"{request.request_id}-img2img-0"]}
        params.seed = seed
        params.extra_args = {**(params.extra_args or {}), "target_h": height, "target_w": width}
        if self._input_processor is None:
            raise EngineError(f"stage {self.stage_name}: its input processor did not start")
        loop = asyncio.get_running_loop()
        try:
            processed = await loop.run_in_executor(
                self._media_thread,
                lambda: self._input_processor.process_inputs(
                    request.request_id, dict(prompt), params, supported_tasks=("generate",)
                ),
            )
        except ValueError as err:  # vLLM's input validation (e.g. a prompt over max_model_len)
            raise InvalidStageInput(f"prompt: {err}", "prompt") from None
        return [int(i) for i in processed.prompt_token_ids], processed.mm_features, prompt

    def spoken(self, request: StageRequest) -> tuple[list[int], list[int]]:
        """The reply to speak as token ids, and the token that ends the assistant's turn after it."""
        tokenizer = self._tokenizer()
        reply = [int(i) for i in tokenizer.encode(request.text_to_speak or "", add_special_tokens=False)]
        if not reply:
            raise InvalidStageInput("input: the text to speak is empty", "input")
        return reply, [self.end_of_turn(request, request.text_to_speak or "")]

    def end_of_turn(self, request: StageRequest, reply: str) -> int:
        """The token that ends an assistant turn saying ``reply``: what the chat template writes after an
        assistant message (Qwen's <|im_end|>), else the tokenizer's EOS."""
        tokenizer = self._tokenizer()
        turns = template_messages(request.messages or [])
        end: int | None = None
        try:
            prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            whole = tokenizer.apply_chat_template([*turns, {"role": "assistant", "content": reply}], tokenize=False)
            if whole.startswith(prompt + reply):
                after = tokenizer.encode(whole[len(prompt) + len(reply) :], add_special_tokens=False)
                end = int(after[0]) if after else None
        except Exception as err:  # a template without an assistant turn: the EOS ends it
            logger.info("stage %s: end of turn from the chat template unavailable (%s)", self.stage_name, err)
        if end is None:
            end = tokenizer.eos_token_id
        if end is None:
            raise EngineError(f"stage {self.stage_name}: no end-of-turn token to end the spoken reply with")
        return int(end)

    async def speech(self, request: StageRequest, params: Any) -> dict[str, Any]:
        """A TTS entry stage's prompt for the text to speak (the pipeline's ``speech_prompt`` hook); ``params``,
        the call's vLLM sampling params, changed in place as the model's speech server changes them."""
        if self._speech is None:
            raise EngineError(
                f"stage {self.stage_name}: pipeline {self.pipeline!r} takes text to speak in a prompt of its own, "
                "and omni_serve has no builder for it yet (omni_serve.models.vllm_omni hooks: speech_prompt)"
            )
        if not (request.text_to_speak or "").strip():
            raise InvalidStageInput("input: the text to speak is empty", "input")
        return await self._speech.prompt(request, params)
