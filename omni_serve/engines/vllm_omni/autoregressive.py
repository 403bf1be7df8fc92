"""``llm_ar`` stages: a prompt -> tokens, as text for the client and/or a handoff for the downstream stage.

What the stage does follows its declaration (``StagePipelineConfig``), whatever its model:

- **Its prompt.** An entry stage builds it from the request (:mod:`.prompts`: chat messages and media,
  or text to speak); a downstream stage from its upstream stages' handoffs, by its declared input
  processor (:func:`omni_serve.models.vllm_omni.edges.consumer_prompt`), or, reading its upstream's
  async chunks (``stream_input``), through its EngineCore's connector (:mod:`.streamed`).
- **Its text.** A stage whose declared final output is text streams text deltas (DELTA outputs:
  vLLM-Omni concatenates the accumulated multimodal output once, at the end).
- **Its handoff.** Whole at the finish, by the stage's producer-side processor; or in chunks as its
  async-chunk processor cuts them, one engine step at a time: packed per engine output for a downstream
  stage that reads them as a stream, or each chunk its own downstream call (``engine_args.chunks``).
  With stop strings or tool calls a text stage hands over whole at the end: a stop string can take back
  tokens already run, a call's tokens are known as such only once parsed, and the downstream stage must
  get only the text the client sees (a reply cut before a call hands over the rows of its text only).
- **Tool calls** (an entry stage with ``engine_args.tool_call_parser``): parsed from its output as it
  decodes with vLLM's parser (:mod:`omni_serve.models.tool_calls`); structured outputs and logprobs are
  the EngineCore's own (vLLM's sampling params).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from omni_serve.engines.logprobs import from_vllm as logprobs_from_vllm
from omni_serve.engines.vllm_omni.engine import VllmOmniEngine
from omni_serve.engines.vllm_omni.mapping import finish_reason, multimodal_output
from omni_serve.engines.vllm_omni.prompts import EntryPrompts
from omni_serve.engines.vllm_omni.streamed import StreamedInput
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.models.tool_calls import ToolCallStream, load_parser, tool_call_stream
from omni_serve.models.vllm_omni import pipelines
from omni_serve.models.vllm_omni.edges import ChunkTransfer, NewRows, first_rows, lookup, run_of, with_entry_prompt
from omni_serve.models.vllm_omni.payload import merge_steps
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, SamplingParams, StageOutput, StageRequest, ToolCallDelta, Usage


@dataclass
class _Call:
    """One generating call's state as its engine outputs come in: what it decoded so far, how it hands over."""

    request: StageRequest
    prompt_ids: list[int]
    params: Any  # vLLM's sampling params of its engine request
    sampling: SamplingParams  # the call's own (tool calls constrain it)
    calls: ToolCallStream | None  # its tool-call parsing
    transfer: ChunkTransfer | None  # its chunk transfer, when its handoff goes downstream in chunks
    entry_prompt: dict[str, Any] | None  # an image request's prompt, which the DiT's processor reads too
    rows: dict[str, NewRows]  # the hooks' generated_rows_only: the rows each output adds
    prompt_text: str | None  # vLLM's return_prompt_text, until the first output carries it
    collected: dict[str, list[Any]] = field(init=False)
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # the reply's pieces, as the client gets them

    def __post_init__(self) -> None:
        self.collected = {key: [] for key in self.rows}


class AutoregressiveEngine(VllmOmniEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.prompts = EntryPrompts(
            stage_name, self.args.pipeline, self.pipeline_hooks, bool(self.args.media), self.declared, self.args.entry
        )
        self.streamed: StreamedInput | None = None
        self.emits_text = bool(self.declared.final_output and self.declared.final_output_type == "text")
        self._speakers: list[str] = []  # the checkpoint's speakers, on a stage that speaks (no text of its own)
        self._generation_config: dict[str, Any] = {}  # an entry stage's, read once (vLLM's input processor's)
        self._tool_parser: Any = None  # vLLM's parser class for engine_args.tool_call_parser

    def check_declaration(self) -> None:
        super().check_declaration()
        if self.is_entry and self.args.entry == "speech" and self.pipeline_hooks.speech_prompt is None:
            raise EngineError(
                f"stage {self.stage_name}: engine_args.entry speech: pipeline {self.args.pipeline!r} builds its "
                "prompt for text to speak per model, and omni_serve has no builder for it yet (docs/models.md)"
            )

    async def _setup(self, hf_config: Any) -> None:
        if self.is_entry:
            self.prompts.start(self._vllm_config, self._tokenizer, self.collective_rpc)
            self.audio_input_rate = self.prompts.audio_input_rate
            self._generation_config = self._vllm_config.model_config.try_get_generation_config()
        if not self.emits_text:
            self._speakers = self.prompts.speakers() or pipelines.speakers(hf_config) or list(self.hooks.speakers)
        name = self.args.tool_call_parser
        # vLLM is loaded in this process already: an unknown parser name fails the start (the graph file is wrong).
        self._tool_parser = load_parser(name) if name else None
        if self.stream_input:
            (upstream,) = self.declared.input_sources
            self.streamed = StreamedInput(
                self.stage_name,
                self.args.stage_id,
                pipelines.stage(self.args.pipeline, upstream),
                self.hooks,
                self._vllm_config,
            )

    def shutdown(self) -> None:
        self.prompts.shutdown()
        if self.streamed is not None:
            self.streamed.shutdown()
        super().shutdown()

    def voices(self) -> list[str]:
        """The speaker names of a stage that speaks (lower case, as vLLM-Omni matches them)."""
        return list(self._speakers)

    def _voice(self, voice: str | None) -> str | None:
        if voice is None or not self._speakers:
            return None
        if voice.lower() not in self._speakers:
            raise InvalidStageInput(f"voice: unknown voice {voice!r}; valid voices: {self._speakers}")
        return voice.lower()

    def merge_handoffs(self, first: HandoffPayload, later: HandoffPayload) -> HandoffPayload:
        return merge_steps(first, later)

    # -- one call ------------------------------------------------------------------

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        voice = self._voice(request.voice)
        if self.is_entry and request.text_to_speak is not None and self.args.entry == "chat":
            async for output in self._speak(request):
                yield output
            return
        calls = self._tool_calls(request)
        sampling = calls.constrained(request.sampling) if calls is not None else request.sampling
        params = self._call_params(request, sampling)
        entry_prompt: dict[str, Any] | None = None
        if self.is_entry and self.args.entry == "image":
            ids, mm_features, entry_prompt = await self.prompts.image(request, params)
            prompt, feed = {"prompt_token_ids": ids}, None
        else:
            prompt, mm_features, feed = await self._prompt(request, handoff, params, voice)
        call = self._call(request, list(prompt["prompt_token_ids"]), params, sampling, calls, entry_prompt)
        async for output in self._request(request, prompt, params, mm_features, feed.run if feed else None):
            if output.finished and feed is not None:
                feed.engine_finished = True  # so its EngineCore sends the request's end marker
            out, apart, mm = self._step(call, output)
            for chunk in apart:  # each chunk its own downstream call, before the output they came with
                yield StageOutput(stage=self.stage_name, handoff=chunk)
            if output.finished:
                self._finish(call, out, output.outputs[0], mm)
            if out.finished or out.text or out.token_ids or out.prompt_text or out.handoff is not None:
                yield out

    def _call_params(self, request: StageRequest, sampling: SamplingParams) -> Any:
        """vLLM sampling params of a generating call: DELTA outputs, the hooks' extra steps, the entry's EOS."""
        # DELTA: each output carries only its new tokens; vLLM-Omni concatenates the accumulated
        # multimodal output once, at the end (CUMULATIVE would re-concatenate it every step).
        extra = self.hooks.extra_steps
        params = self._params(
            request, "DELTA", sampling, **({"max_tokens": request.sampling.max_tokens + extra} if extra else {})
        )
        self._stop_at_eos(params)
        return params

    def _call(
        self,
        request: StageRequest,
        prompt_ids: list[int],
        params: Any,
        sampling: SamplingParams,
        calls: ToolCallStream | None,
        entry_prompt: dict[str, Any] | None,
    ) -> _Call:
        """The state of a call about to run on ``prompt_ids`` (refused when empty)."""
        if not prompt_ids:  # the EngineCore would die on it (assert num_new_tokens > 0)
            raise EngineError(f"stage {self.stage_name}: its upstream's handoff has nothing for it to run on")
        transfer = self._transfer(request, prompt_ids, params, whole=calls is not None)
        rows = {key: NewRows(placeholders=True) for key in self.hooks.generated_rows_only}
        # vLLM's return_prompt_text: the prompt as the model sees it (media placeholders expanded), once.
        prompt_text = (
            self._tokenizer.decode(prompt_ids, skip_special_tokens=False)
            if request.return_prompt_text and self.is_entry and self._tokenizer is not None
            else None
        )
        return _Call(request, prompt_ids, params, sampling, calls, transfer, entry_prompt, rows, prompt_text)

    def _step(self, call: _Call, output: Any) -> tuple[StageOutput, list[HandoffPayload], dict[str, Any]]:
        """One engine output: the call's output for it (the finish aside), the chunks that go downstream as their
        own outputs before it (``engine_args.chunks``), and the output's multimodal output (if read)."""
        completion = output.outputs[0]
        new_ids = list(completion.token_ids)
        call.token_ids.extend(new_ids)
        piece, tool_calls = completion.text, list[ToolCallDelta]()
        if call.calls is not None:  # the client gets the reply without its calls, the calls apart
            piece, tool_calls = call.calls.push(completion.text, new_ids, output.finished)
        call.text.append(piece)
        mm = multimodal_output(output) if call.rows or call.transfer is not None or output.finished else {}
        for key, seen in call.rows.items():
            fresh = seen.new(lookup(mm, key))
            if fresh is not None:
                call.collected[key].append(fresh)
        out = StageOutput(stage=self.stage_name)
        if self.emits_text:
            out.text, out.token_ids, out.tool_calls = piece, new_ids, tool_calls
            out.usage = Usage(prompt_tokens=len(call.prompt_ids), completion_tokens=len(call.token_ids))  # so far
            if call.sampling.logprobs is not None and completion.logprobs is not None:
                out.logprobs = logprobs_from_vllm(new_ids, completion.logprobs, call.sampling.logprobs)
        out.prompt_text, call.prompt_text = call.prompt_text, None
        apart: list[HandoffPayload] = []
        if call.transfer is not None:
            chunks = call.transfer.push(mm, call.token_ids, output.finished)
            if self.args.chunks is not None:  # each chunk its own downstream call
                out.handoff = chunks.pop() if output.finished and chunks else None
                apart = chunks
            else:  # the downstream stage reads them as a stream: this output's steps in one item
                out.handoff = run_of(chunks)
        return out, apart, mm

    def _finish(self, call: _Call, out: StageOutput, completion: Any, mm: dict[str, Any]) -> None:
        """The call's last output: its finish reason and usage, and its whole handoff (when it goes whole)."""
        import torch

        request, prompt_ids, calls = call.request, call.prompt_ids, call.calls
        out.finished = True
        reason = finish_reason(completion.finish_reason)
        out.finish_reason = calls.finish_reason(reason) if calls is not None else reason
        out.usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(call.token_ids))
        stopped = completion.finish_reason == "stop"
        spoken = calls.spoken if calls is not None else len(call.token_ids)
        if spoken < len(call.token_ids):  # a tool call followed: the rows of the text before it, ended as a turn
            mm = first_rows(mm, len(prompt_ids) + spoken, len(prompt_ids))
            end = self.prompts.end_of_turn(request, "".join(call.text))
            call.token_ids, stopped = [*call.token_ids[:spoken], end], True
        # Text-only requests, and a reply that is only a tool call: nobody would read it.
        if request.wants_handoff and call.transfer is None and spoken:
            out.handoff = self.producer().whole(
                request.request_id,
                prompt_ids,
                call.token_ids,
                mm,
                text="".join(call.text),
                stopped=stopped,
                rows={key: torch.cat(parts) if parts else None for key, parts in call.collected.items()},
            )
            if out.handoff is None:  # its declared processor withheld it: the next stage would wait for nothing
                raise EngineError(f"stage {self.stage_name}: its declared processor handed nothing downstream")
            if call.entry_prompt is not None:
                out.handoff = with_entry_prompt(out.handoff, call.entry_prompt, call.params.seed)

    async def _prompt(
        self, request: StageRequest, handoff: HandoffPayload | None, params: Any, voice: str | None
    ) -> tuple[dict[str, Any], Any, Any]:
        """(prompt, media features, streamed input feed) of one call."""
        if self.is_entry:
            if request.text_to_speak is not None:  # entry: speech (a TTS model's own prompt)
                return await self.prompts.speech(request, params), None, None
            ids, mm_features = await self.prompts.chat(request, params)
            return {"prompt_token_ids": ids}, mm_features, None
        if self.streamed is not None:  # its EngineCore reads chunks only: a whole handoff is a stream of one
            chunks = request.handoff_stream if request.handoff_stream is not None else _one(self._handoff_in(handoff))
            prompt, feed = await self.streamed.prompt_and_feed(chunks, voice)
            return prompt, None, feed
        return self._consumer_prompt(request, handoff, voice=voice), None, None

    def _stop_at_eos(self, params: Any) -> None:
        """An entry stage stops at its tokenizer's EOS and its generation config's EOS ids.

        vLLM's input processor adds these to every request's sampling params
        (``SamplingParams.update_from_generation_config``; vLLM-Omni runs its entry stage's requests through
        it), and the EngineCore stops only at the EOS its params name. These requests are built from tokens
        without that processor: without this a reply ran on past its end of turn to ``max_tokens``, even where
        a structured-output constraint (a forced tool call) had ended it with the EOS (finish ``length``), and
        a TTS entry that ends its speech with the EOS (Voxtral's LM writes it on the ``[END_AUDIO]`` code) ran
        on to ``max_tokens``. Downstream stages stop at their declared stop ids (``sampling_constraints``), as
        vLLM-Omni's do.
        """
        if not self.is_entry or self._tokenizer is None:
            return
        params.update_from_generation_config(self._generation_config, self._tokenizer.eos_token_id)

    def _tool_calls(self, request: StageRequest) -> ToolCallStream | None:
        """The request's tool-call parsing (None without tools, or with ``tool_choice: none``)."""
        return tool_call_stream(
            request.tools, self._tool_parser, self.stage_name, self.args.tool_call_parser, self._tokenizer
        )

    def _transfer(
        self, request: StageRequest, prompt_ids: list[int], params: Any, whole: bool = False
    ) -> ChunkTransfer | None:
        """The call's chunk transfer when its handoff goes downstream in chunks (None: whole, or none);
        ``whole``: a text stage's reply goes whole (tool calls)."""
        if not request.wants_handoff or not self.declared.async_chunk_process_next_stage_input_func:
            return None
        streams = request.stream_handoff and not (self.emits_text and (request.sampling.stop or whole))
        if self.args.chunks is None and not streams:
            return None
        return self.producer().chunks(request.request_id, prompt_ids, list(params.stop_token_ids or ()))

    async def _speak(self, request: StageRequest) -> AsyncIterator[StageOutput]:
        """Teacher-force ``request.text_to_speak`` as the assistant turn (text to speak, on a chat entry stage).

        The reply's tokens are appended to the prompt and the engine runs one prefill over all of them,
        sampling a single token that is then replaced by the end-of-turn token: the multimodal output is
        that of exactly this text, the same rows generation would have produced had it sampled these
        tokens and stopped (the end-of-turn token's own row is never computed).
        """
        if request.media:
            raise InvalidStageInput("input: text to speak takes no media", "input")
        prompt_ids, _ = await self.prompts.chat(request, None)
        reply, end = self.prompts.spoken(request)
        params = self._params(request, "FINAL_ONLY", max_tokens=1, temperature=0.0, stop=[], stop_token_ids=[])
        async for output in self._request(request, {"prompt_token_ids": prompt_ids + reply}, params):
            if not output.finished:
                continue
            handoff = None
            if request.wants_handoff:
                mm = multimodal_output(output)
                transfer = self._transfer(request, prompt_ids, params)
                if transfer is not None:  # the whole reply's rows as its chunks
                    chunks = transfer.push(mm, [*reply, *end], True)
                    handoff = run_of(chunks) if self.args.chunks is None else (chunks[-1] if chunks else None)
                    for chunk in chunks[:-1] if self.args.chunks is not None else ():
                        yield StageOutput(stage=self.stage_name, handoff=chunk)
                else:
                    handoff = self.producer().whole(
                        request.request_id,
                        prompt_ids,
                        [*reply, *end],
                        mm,
                        text=request.text_to_speak or "",
                        stopped=True,
                    )
            yield StageOutput(
                stage=self.stage_name,
                text=request.text_to_speak or "",
                token_ids=reply,
                finished=True,
                finish_reason=FinishReason.STOP,
                usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(reply) + len(end)),
                handoff=handoff,
            )


async def _one(handoff: HandoffPayload) -> AsyncIterator[HandoffPayload]:
    yield handoff
