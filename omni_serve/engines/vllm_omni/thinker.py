"""The thinker role of a vLLM-Omni stage: chat messages (and media) -> text deltas, then the thinker -> talker handoff.

With ``request.reply`` set (text to speech) it teacher-forces that reply instead of generating
(:meth:`ThinkerEngine._speak`). Prompts with media go through vLLM-Omni's stage-0 input processor
on a thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from omni_serve.engines.vllm_omni.engine import VllmOmniEngine
from omni_serve.engines.vllm_omni.mapping import chat_prompt_ids, finish_reason, multimodal_output, multimodal_prompt
from omni_serve.models import qwen3_omni
from omni_serve.models import vllm_omni_handoffs as handoffs
from omni_serve.payload import HandoffPayload
from omni_serve.types import EngineError, FinishReason, InvalidStageInput, StageOutput, StageRequest, Usage

logger = logging.getLogger("ray.serve")


class ThinkerEngine(VllmOmniEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self._input_processor: Any = None  # vLLM's input processor for prompts with media
        self._media_thread: Any = None

    async def _setup(self, hf_config: Any) -> None:
        if self._tokenizer is not None:
            self._start_media_input()

    def shutdown(self) -> None:
        if self._media_thread is not None:
            self._media_thread.shutdown(wait=False, cancel_futures=True)
        super().shutdown()

    def _start_media_input(self) -> None:
        """The stage-0 input processor vLLM-Omni builds for its entry stage: it runs the checkpoint's HF
        processor on a prompt's media and expands the placeholders. It runs on one thread of its own
        (the HF processor is CPU-bound; vLLM's processor cache is not shared between threads)."""
        from concurrent.futures import ThreadPoolExecutor

        from vllm_omni.engine.stage_init_utils import build_stage0_input_processor

        self._input_processor = build_stage0_input_processor(self._vllm_config)
        self._media_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.stage_name}-media")
        try:
            info = self._input_processor.renderer.mm_processor.info
            self.audio_input_rate = int(info.get_feature_extractor().sampling_rate)
        except Exception as err:  # a pipeline without a feature extractor: Whisper's rate
            logger.info("stage %s: audio input rate from the processor unavailable (%s)", self.stage_name, err)

    async def _media_prompt(
        self, request: StageRequest, turns: list[dict[str, Any]], params: Any
    ) -> tuple[list[int], Any]:
        """Prompt ids with the media placeholders expanded, and the media features for the EngineCore."""
        try:
            text = self._tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
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

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        if not request.messages:
            raise InvalidStageInput(f"stage {self.stage_name}: the entry stage needs messages")
        if self._tokenizer is None:
            raise EngineError(f"stage {self.stage_name}: the thinker needs its tokenizer (skip_tokenizer_init set)")
        turns = qwen3_omni.template_messages(request.messages)
        # DELTA: each output carries only its new tokens; vLLM-Omni concatenates the accumulated
        # hidden states once, at the end (CUMULATIVE would re-concatenate them every step).
        params = self._params(request, "DELTA")
        mm_features = None
        if request.media:
            prompt_ids, mm_features = await self._media_prompt(request, turns, params)
        else:
            prompt_ids = chat_prompt_ids(self._tokenizer, turns)
        if request.reply is not None:
            async for output in self._speak(request, prompt_ids):
                yield output
            return
        token_ids: list[int] = []
        # Stop strings: the rows go whole at the end (a stop string can take back tokens already run, and
        # the talker must speak only what the client sees; the talker reads them as their chunks).
        streams = request.stream_handoff and request.wants_handoff and not request.sampling.stop
        chunks = self._chunks(request, prompt_ids) if streams else None
        # vLLM's return_prompt_text: the prompt as the model sees it (media placeholders expanded), once.
        prompt_text = (
            self._tokenizer.decode(prompt_ids, skip_special_tokens=False) if request.return_prompt_text else None
        )
        async for output in self._request(request, {"prompt_token_ids": prompt_ids}, params, mm_features):
            completion = output.outputs[0]
            token_ids.extend(completion.token_ids)
            delta = StageOutput(
                stage=self.stage_name,
                text=completion.text,
                token_ids=list(completion.token_ids),
                usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids)),  # so far
            )
            delta.prompt_text, prompt_text = prompt_text, None
            if chunks is not None:  # streamed: the talker's input as this step completes it
                delta.handoff = chunks.push(multimodal_output(output), token_ids, output.finished)
            if output.finished:
                delta.finished = True
                delta.finish_reason = finish_reason(completion.finish_reason)
                if request.wants_handoff and chunks is None:  # text-only requests: nobody would read them
                    delta.handoff = handoffs.thinker_handoff(
                        self.args.pipeline,
                        request_id=request.request_id,
                        prompt_token_ids=prompt_ids,
                        output_token_ids=token_ids,
                        multimodal_output=multimodal_output(output),
                        hf_config=self._vllm_config.model_config.hf_config,
                        stopped=completion.finish_reason == "stop",
                    )
            if delta.finished or delta.text or delta.token_ids or delta.prompt_text or delta.handoff is not None:
                yield delta

    def _chunks(self, request: StageRequest, prompt_ids: list[int]) -> handoffs.ThinkerChunkTransfer:
        """The streamed talker input of one request, cut as vLLM-Omni's async-chunk connector cuts it."""
        return handoffs.ThinkerChunkTransfer(
            self.args.pipeline, request.request_id, self._vllm_config.model_config.hf_config, prompt_ids
        )

    def merge_handoffs(self, first: HandoffPayload, later: HandoffPayload) -> HandoffPayload:
        return handoffs.merge_chunks(first, later)

    async def _speak(self, request: StageRequest, prompt_ids: list[int]) -> AsyncIterator[StageOutput]:
        """Teacher-force ``request.reply`` as the assistant turn (text to speech).

        The reply's tokens are appended to the prompt and the engine runs one prefill over
        all of them, sampling a single token that is then replaced by <|im_end|>: the hidden
        states are those of exactly this text, the same rows generation would have produced
        had it sampled these tokens and stopped (the stop token's own row is never computed).
        """
        reply = [int(i) for i in self._tokenizer.encode(request.reply or "", add_special_tokens=False)]
        if not reply:
            raise InvalidStageInput("input: the text to speak is empty")
        im_end = self._tokenizer.convert_tokens_to_ids("<|im_end|>")
        params = self._params(request, "FINAL_ONLY", max_tokens=1, temperature=0.0, stop=[], stop_token_ids=[])
        async for output in self._request(request, {"prompt_token_ids": prompt_ids + reply}, params):
            if not output.finished:
                continue
            handoff = None
            if request.wants_handoff and request.stream_handoff:  # the whole reply's rows as its chunks
                handoff = self._chunks(request, prompt_ids).push(multimodal_output(output), [*reply, im_end], True)
            elif request.wants_handoff:
                handoff = handoffs.thinker_handoff(
                    self.args.pipeline,
                    request_id=request.request_id,
                    prompt_token_ids=prompt_ids,
                    output_token_ids=[*reply, im_end],
                    multimodal_output=multimodal_output(output),
                    hf_config=self._vllm_config.model_config.hf_config,
                    stopped=True,
                )
            yield StageOutput(
                stage=self.stage_name,
                text=request.reply or "",
                token_ids=reply,
                finished=True,
                finish_reason=FinishReason.STOP,
                usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(reply) + 1),
                handoff=handoff,
            )
