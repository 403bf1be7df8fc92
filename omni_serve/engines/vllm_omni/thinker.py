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

from omni_serve.engines.logprobs import from_vllm as logprobs_from_vllm
from omni_serve.engines.vllm_omni.engine import VllmOmniEngine
from omni_serve.engines.vllm_omni.mapping import chat_prompt_ids, finish_reason, multimodal_output, multimodal_prompt
from omni_serve.models import qwen3_omni
from omni_serve.models import vllm_omni_handoffs as handoffs
from omni_serve.models.tool_calls import ToolCallStream, load_parser, parser_or_refuse
from omni_serve.payload import HandoffPayload
from omni_serve.types import (
    EngineError,
    FinishReason,
    InvalidStageInput,
    StageOutput,
    StageRequest,
    ToolCallDelta,
    Usage,
)

logger = logging.getLogger("ray.serve")


class ThinkerEngine(VllmOmniEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self._input_processor: Any = None  # vLLM's input processor for prompts with media
        self._media_thread: Any = None
        self._tool_parser: Any = None  # vLLM's parser class for engine_args.tool_call_parser

    async def _setup(self, hf_config: Any) -> None:
        if self._tokenizer is not None:
            self._start_media_input()
        name = self.args.tool_call_parser
        # vLLM is loaded in this process already: an unknown parser name fails the start (the graph file is wrong).
        self._tool_parser = load_parser(name) if name else None

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
        self, request: StageRequest, turns: list[dict[str, Any]], params: Any, tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], Any]:
        """Prompt ids with the media placeholders expanded, and the media features for the EngineCore."""
        try:
            text = self._tokenizer.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=True)
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
        tools = request.tools.tools if request.tools else None
        calls = self._tool_calls(request)
        sampling = calls.constrained(request.sampling) if calls is not None else request.sampling
        # DELTA: each output carries only its new tokens; vLLM-Omni concatenates the accumulated
        # hidden states once, at the end (CUMULATIVE would re-concatenate them every step).
        params = self._params(request, "DELTA", sampling)
        mm_features = None
        if request.media:
            prompt_ids, mm_features = await self._media_prompt(request, turns, params, tools)
        else:
            prompt_ids = chat_prompt_ids(self._tokenizer, turns, tools)
        if request.reply is not None:
            async for output in self._speak(request, prompt_ids):
                yield output
            return
        token_ids: list[int] = []
        # Stop strings, tool calls: the rows go whole at the end (a stop string can take back tokens already
        # run, a call's tokens are known as such only once parsed, and the talker must speak only the text the
        # client sees; the talker reads them as their chunks).
        streams = request.stream_handoff and request.wants_handoff and not sampling.stop and calls is None
        chunks = self._chunks(request, prompt_ids) if streams else None
        # vLLM's return_prompt_text: the prompt as the model sees it (media placeholders expanded), once.
        prompt_text = (
            self._tokenizer.decode(prompt_ids, skip_special_tokens=False) if request.return_prompt_text else None
        )
        async for output in self._request(request, {"prompt_token_ids": prompt_ids}, params, mm_features):
            completion = output.outputs[0]
            new_ids = list(completion.token_ids)
            token_ids.extend(new_ids)
            text, tool_calls = completion.text, list[ToolCallDelta]()
            if calls is not None:
                text, tool_calls = calls.push(completion.text, new_ids, output.finished)
            delta = StageOutput(
                stage=self.stage_name,
                text=text,
                token_ids=new_ids,
                usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids)),  # so far
                tool_calls=tool_calls,
            )
            if sampling.logprobs is not None and completion.logprobs is not None:
                delta.logprobs = logprobs_from_vllm(new_ids, completion.logprobs, sampling.logprobs)
            delta.prompt_text, prompt_text = prompt_text, None
            if chunks is not None:  # streamed: the talker's input as this step completes it
                delta.handoff = chunks.push(multimodal_output(output), token_ids, output.finished)
            if output.finished:
                delta.finished = True
                reason = finish_reason(completion.finish_reason)
                delta.finish_reason = calls.finish_reason(reason) if calls is not None else reason
                spoken = calls.spoken if calls is not None else len(token_ids)
                if request.wants_handoff and chunks is None and spoken:  # text-only requests: nobody would read it
                    delta.handoff = self._whole_handoff(
                        request, prompt_ids, token_ids, spoken, output, completion.finish_reason == "stop"
                    )
            if delta.finished or delta.text or delta.token_ids or delta.prompt_text or delta.handoff is not None:
                yield delta

    def _tool_calls(self, request: StageRequest) -> ToolCallStream | None:
        """The request's tool-call parsing (None without tools, or with ``tool_choice: none``)."""
        tools = request.tools
        if tools is None or tools.choice == "none":
            return None
        parser = parser_or_refuse(self._tool_parser, self.stage_name, self.args.tool_call_parser)
        return ToolCallStream(parser, self._tokenizer, tools)

    def _whole_handoff(
        self,
        request: StageRequest,
        prompt_ids: list[int],
        token_ids: list[int],
        spoken: int,
        output: Any,
        stopped: bool,
    ) -> HandoffPayload | None:
        """The thinker -> talker handoff of the reply's first ``spoken`` tokens (all, unless a tool call followed
        them): a cut reply ends as a spoken one does, with <|im_end|> after its last row."""
        mm = multimodal_output(output)
        if spoken < len(token_ids):
            mm = handoffs.first_rows(mm, len(prompt_ids) + spoken)
            token_ids, stopped = [*token_ids[:spoken], self._tokenizer.convert_tokens_to_ids("<|im_end|>")], True
        return handoffs.thinker_handoff(
            self.args.pipeline,
            request_id=request.request_id,
            prompt_token_ids=prompt_ids,
            output_token_ids=token_ids,
            multimodal_output=mm,
            hf_config=self._vllm_config.model_config.hf_config,
            stopped=stopped,
        )

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
