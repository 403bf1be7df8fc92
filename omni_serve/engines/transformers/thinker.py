"""The thinker stage: chat messages (and media) -> streamed text, then the thinker -> talker handoff."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from omni_serve.engines.grammar import GrammarCompiler, grammar_available, grammar_processor
from omni_serve.engines.logprobs import LogprobRecorder
from omni_serve.engines.transformers.sampling import end_ids, generation_config, seed, stopping
from omni_serve.engines.transformers.worker import RNG_LOCK, Emit, HFEngine, logger
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.models import qwen3_omni
from omni_serve.models.chat_template import template_messages
from omni_serve.models.processor_media import processor_media
from omni_serve.models.tool_calls import ParserLoader, ToolCallStream, merge_deltas, tool_call_stream
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, SamplingParams, StageOutput, StageRequest, TextPart, ToolCallDelta, Usage


class _TextStream:
    """Incremental detokenization with stop strings, fed one generated token at a time.

    Emitted text never changes afterwards: trailing U+FFFD (a UTF-8 sequence still being
    completed by the next byte tokens) and the last ``len(longest stop) - 1`` characters
    (a stop string may be forming) are held back until ``finish``.
    """

    def __init__(self, tokenizer: Any, stop: list[str], stop_token_ids: set[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._stop_ids = stop_token_ids
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text_ids: list[int] = []
        self._text_len: list[int] = []  # len(_text_ids) after each generated token
        self.text = ""
        self.emitted = 0
        self.stop_at: int | None = None  # char offset of the matched stop string

    def add(self, token_id: int) -> str:
        if self.stop_at is not None:
            return ""
        if token_id not in self._stop_ids:  # a stop token ends the text without showing in it
            self._text_ids.append(token_id)
        self._text_len.append(len(self._text_ids))
        text = self._tok.decode(self._text_ids, skip_special_tokens=self._skip_special)
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stop_at = min(hits)
            self.text = text[: self.stop_at]
            return self._emit(len(self.text))
        self.text = text
        end = len(text) - self._hold
        while end > self.emitted and text[end - 1] == "\ufffd":
            end -= 1
        return self._emit(end)

    def finish(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def tokens_before_stop(self) -> int:
        """How many generated tokens lie wholly before the stop string (all of them if none matched)."""
        k = len(self._text_len)
        if self.stop_at is None:
            return k
        while k > 0 and len(self._decode_first(self._text_len[k - 1])) > self.stop_at:
            k -= 1
        return k

    def _decode_first(self, n: int) -> str:
        return self._tok.decode(self._text_ids[:n], skip_special_tokens=self._skip_special)


class ThinkerEngine(HFEngine):
    """Chat messages -> streamed text, then the thinker2talker handoff."""

    def _setup(self, model: Any) -> None:
        import torch
        from transformers import AutoTokenizer

        self.thinker = model.thinker
        # generate() samples from the last position's logits only, but the thinker's forward has no
        # `logits_to_keep` (transformers 5.14.1; the argument generate() passes to models that take it,
        # huggingface/transformers#31292), so its prefill projects every prompt position onto the
        # 152k-token vocabulary: 31 of the 36 ms of a 64-token prefill of the tiny thinker, all of it
        # before the first token. The head sees only the last position instead (its hidden states,
        # which the talker gets, are untouched; decoding steps have one position anyway).
        self.thinker.lm_head.register_forward_pre_hook(lambda _head, args: (args[0][:, -1:],))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        cfg = self.config
        self.context_len = int(cfg.thinker_config.text_config.max_position_embeddings)
        self.eos_ids = sorted(
            {
                i
                for i in (self.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
                if isinstance(i, int) and i >= 0
            }
        )
        tc = cfg.thinker_config
        self.reserved_ids = {
            tc.audio_token_id,
            tc.image_token_id,
            tc.video_token_id,
            tc.audio_start_token_id,
            getattr(tc, "vision_start_token_id", -1),
        }
        self.accept_layer = int(cfg.talker_config.accept_hidden_layer)
        self.grammars = GrammarCompiler(self.tokenizer, int(self.thinker.lm_head.out_features))
        name = self.args.tool_call_parser
        self.tool_parser = ParserLoader(name) if name else None  # vLLM's parser, loaded on first use
        with torch.inference_mode():
            tts_ids = torch.tensor([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])
            self.tts_embeds = self.thinker.get_input_embeddings()(tts_ids.to(self.thinker.device))
        # The checkpoint's processor (feature extractor, image and video processors) turns media into
        # encoder inputs and expands their placeholders. Its image/video processors need torchvision;
        # without it the thinker still serves text and refuses media with a 500 naming the cause.
        self.processor: Any = None
        self.processor_error = ""
        try:
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(self.model_path)
            self.audio_input_rate = int(self.processor.feature_extractor.sampling_rate)
        except Exception as err:
            self.processor_error = f"{type(err).__name__}: {err}"
            logger.warning("stage %s: no media input, the processor did not load (%s)", self.stage_name, err)

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        if not request.messages:
            raise InvalidStageInput(f"stage {self.stage_name}: the thinker needs chat messages", "messages")
        calls = await self._tool_calls(request)
        sampling = calls.constrained(request.sampling) if calls is not None else request.sampling
        # Compiled before the request takes the worker: the others' steps go on meanwhile (grammar.py).
        grammar = await self._grammar(sampling, calls) if request.text_to_speak is None else None

        def job(emit: Emit, cancelled: threading.Event) -> None:
            self._generate(request, sampling, calls, grammar, emit, cancelled)

        async with contextlib.aclosing(self._run(request.request_id, job)) as batches:
            async for batch in batches:
                deltas = [item for item in batch if item[0] == "delta"]
                text = "".join(item[1] for item in deltas)
                token_ids = [t for item in deltas for t in item[2]]
                logprobs = [item[4] for item in deltas if item[4] is not None] or None
                tool_calls: list[ToolCallDelta] = []
                for item in deltas:
                    tool_calls = merge_deltas(tool_calls, item[5])
                prompt = next((item[1] for item in batch if item[0] == "prompt"), None)
                final = next((item for item in batch if item[0] == "final"), None)
                # Streamed handoff: the rows this batch's steps ran, one chunk per output.
                chunks = [item[1] for item in batch if item[0] == "rows"]
                chunk = qwen3_omni.merge_thinker_chunks(chunks) if chunks else None
                if final is None:
                    usage = next(
                        (item[3] if item[0] == "delta" else item[2] for item in reversed(batch) if item[0] != "final"),
                        None,
                    )
                    yield StageOutput(
                        stage=self.stage_name,
                        text=text,
                        token_ids=token_ids,
                        prompt_text=prompt,
                        usage=usage,
                        handoff=chunk,
                        logprobs=logprobs,
                        tool_calls=tool_calls,
                    )
                else:
                    _, tail, reason, usage, payload, tail_calls = final
                    payload = payload if payload is not None else chunk
                    yield StageOutput(
                        stage=self.stage_name,
                        text=text + tail,
                        token_ids=token_ids,
                        finished=True,
                        finish_reason=reason,
                        usage=usage,
                        handoff=payload,
                        prompt_text=prompt,
                        logprobs=logprobs,
                        tool_calls=merge_deltas(tool_calls, tail_calls),
                    )

    async def _tool_calls(self, request: StageRequest) -> ToolCallStream | None:
        """The request's tool-call parsing (None without tools, or with ``tool_choice: none``); waits for the
        parser still loading (:class:`ParserLoader`)."""
        tools = request.tools
        if tools is None or tools.choice == "none":
            return None
        loaded: Any = None
        if self.tool_parser is not None:
            try:
                loaded = await asyncio.wrap_future(self.tool_parser.future())
            except Exception as err:
                loaded = err
        return tool_call_stream(tools, loaded, self.stage_name, self.args.tool_call_parser, self.tokenizer)

    def merge_handoffs(self, first: HandoffPayload, later: HandoffPayload) -> HandoffPayload:
        return qwen3_omni.merge_thinker_chunks([first, later])

    def _reserved_in(self, text: str) -> bool:
        return bool(self.reserved_ids.intersection(self.tokenizer.encode(text, add_special_tokens=False)))

    def _prompt(self, request: StageRequest) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """Prompt ids [1, T]; with media also the processor's encoder inputs for ``generate`` and
        what the talker's RoPE needs of them (:func:`qwen3_omni.rope_inputs`)."""
        field = "input" if request.text_to_speak is not None else "messages"
        for message in request.messages or []:  # the template adds no reserved token; the text must not either
            parts = [message.content] if isinstance(message.content, str) else message.content
            for text in (p if isinstance(p, str) else p.text for p in parts if isinstance(p, str | TextPart)):
                if self._reserved_in(text):
                    raise InvalidStageInput("messages: the prompt contains reserved multimodal tokens", field)
        tools = request.tools.tools if request.tools else None
        for i, tool in enumerate(tools or []):  # the template writes each tool's name, description and schema
            if self._reserved_in(json.dumps(tool, ensure_ascii=False)):
                raise InvalidStageInput(f"tools.{i}: the tool contains reserved multimodal tokens", f"tools.{i}")
        turns = template_messages(request.messages or [])
        try:
            text = self.tokenizer.apply_chat_template(turns, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # jinja2 raises TemplateError for conversations the template refuses
            raise InvalidStageInput(f"messages: the model's chat template refused them: {err}", field) from None
        if not request.media:
            ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            return ids.to(self.thinker.device), {}, {}
        if self.processor is None:
            raise EngineError(f"stage {self.stage_name}: cannot take media input ({self.processor_error})")
        media = processor_media(request.media)
        inputs = self.processor(text=text, return_tensors="pt", **{**self.args.mm_processor_kwargs, **media})
        inputs = dict(inputs.to(self.thinker.device, dtype=self.thinker.dtype))
        inputs.pop("attention_mask", None)
        ids = inputs.pop("input_ids")
        generate_inputs = {**inputs, "use_audio_in_video": bool(media.get("use_audio_in_video"))}
        return ids, generate_inputs, qwen3_omni.rope_inputs(inputs)

    def _generate(
        self,
        request: StageRequest,
        s: SamplingParams,
        calls: ToolCallStream | None,
        grammar: Any,
        emit: Emit,
        cancelled: threading.Event,
    ) -> None:
        """The reply to ``request`` under sampling ``s`` (its tool calls' constraint applied), ``grammar``
        the compiled structured-output grammar (None: unconstrained)."""
        import torch

        input_ids, media_inputs, rope = self._prompt(request)
        prompt_len = self._within_context(request, input_ids, emit)
        if request.text_to_speak is not None:
            self._speak(request, input_ids, emit)
            return
        vocab = int(self.thinker.lm_head.out_features)
        outside = sorted(t for t in s.logit_bias or {} if not 0 <= t < vocab)
        if outside:
            raise InvalidStageInput(f"logit_bias: token id {outside[0]} is not in the model's vocabulary", "logit_bias")
        eos = end_ids(self.eos_ids, set(s.stop_token_ids), s.ignore_eos)
        # The tokens that end the generation never show in the text (as in vLLM), special or not.
        text = _TextStream(self.tokenizer, s.stop, set(eos), s.skip_special_tokens)
        recorder = LogprobRecorder(self.thinker.lm_head, self.tokenizer, s.logprobs) if s.logprobs is not None else None
        reply = _Reply(prompt_len, text, calls, recorder, emit)
        # Streamed handoff: each forward's rows go out as they are computed (the prompt's with the
        # prefill, then one reply position per step), those of tool calls never (_RowGate). Stop strings
        # can take back tokens already run, so a request with stop strings hands its rows over whole at the end.
        streamed = request.wants_handoff and request.stream_handoff and not s.stop
        gate = _RowGate(calls, emit, reply.usage) if streamed else None
        hook = self.thinker.register_forward_hook(self._rows_sender(input_ids, rope, gate)) if gate else None
        try:
            with RNG_LOCK, torch.inference_mode():
                torch.manual_seed(seed(s))
                out = self.thinker.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    **media_inputs,
                    generation_config=generation_config(
                        s,
                        max_new_tokens=min(s.max_tokens, self.context_len - prompt_len),
                        eos_token_id=eos,
                        pad_token_id=self.tokenizer.pad_token_id,
                        output_hidden_states=request.wants_handoff,  # text-only requests skip the hidden states
                        return_dict_in_generate=True,
                    ),
                    logits_processor=self._processors(s, grammar),
                    streamer=reply,
                    stopping_criteria=stopping(cancelled, self.args.min_step_s, lambda: text.stop_at is not None),
                )
        finally:
            if hook is not None:
                hook.remove()
            if recorder is not None:
                recorder.close()
        reason = reply.finish_reason(eos, cancelled.is_set())
        tail, tail_calls = text.finish(), list[ToolCallDelta]()
        kept = text.tokens_before_stop()
        if calls is not None:
            tail, tail_calls = calls.push(tail, [], True)
            reason = calls.finish_reason(reason)
            kept = min(kept, calls.spoken)  # the talker speaks only the text the client sees
        if gate is not None:
            gate.release()  # rows the last text confirmed
        whole = request.wants_handoff and not streamed
        payload = self._handoff(out, prompt_len, kept, rope) if whole else None
        emit(("final", tail, reason, reply.usage(), payload, tail_calls))

    def _within_context(self, request: StageRequest, input_ids: Any, emit: Emit) -> int:
        """The prompt's length, refused when it leaves no room in the context; its text emitted when asked for.

        Every item but the final carries the usage so far (the final, the total).
        """
        prompt_len = int(input_ids.shape[1])
        if prompt_len >= self.context_len:
            raise InvalidStageInput(
                f"messages: the prompt has {prompt_len} tokens; the model's context is "
                f"{self.context_len} tokens and generation needs at least one more",
                "input" if request.text_to_speak is not None else "messages",
            )
        if request.return_prompt_text:
            emit(("prompt", self.tokenizer.decode(input_ids[0], skip_special_tokens=False), Usage(prompt_len)))
        return prompt_len

    def _processors(self, s: SamplingParams, grammar: Any) -> Any:
        """The logits processors of a request: its structured-output grammar's, if any."""
        from transformers import LogitsProcessorList

        processors = LogitsProcessorList()
        if grammar is not None:
            processors.append(grammar_processor(grammar, end_ids(self.eos_ids, set(s.stop_token_ids), False)))
        return processors

    async def _grammar(self, s: SamplingParams, calls: ToolCallStream | None) -> Any:
        """The compiled grammar of ``s.structured_outputs`` (a forced tool call's, or the client's constraint),
        compiled on the compiler's thread; None without one."""
        if s.structured_outputs is None:
            return None
        forced = calls is not None and calls.request.structured_outputs is not None
        param = "tool_choice" if forced else "response_format"
        if not grammar_available():
            raise InvalidStageInput(
                f"{param}: stage '{self.stage_name}' constrains its output with xgrammar, which is not installed "
                "(it comes with vLLM)",
                param,
            )
        return await asyncio.wrap_future(self.grammars.submit(s.structured_outputs, param))

    def _rows_sender(self, input_ids: Any, rope: dict[str, Any], gate: _RowGate) -> Callable[..., None]:
        """A forward hook on the thinker that hands each forward's rows to ``gate``: the prompt's payload with
        the prefill, then one reply position's rows chunk per decoding step."""
        prompt_len = int(input_ids.shape[1])
        first = True

        def send(module: Any, args: Any, output: Any) -> None:
            nonlocal first
            states = output.hidden_states
            embeds, hidden = states[0][0], states[self.accept_layer][0]
            if first:
                first = False
                gate.prompt(
                    qwen3_omni.build_thinker2talker(
                        token_ids=input_ids[0].tolist(),
                        prompt_len=prompt_len,
                        embeds=embeds,
                        hidden=hidden,
                        tts_embeds=self.tts_embeds,
                        accept_hidden_layer=self.accept_layer,
                        rope=rope,
                        streamed=True,
                    )
                )
            else:
                gate.reply(qwen3_omni.thinker_rows_chunk(embeds, hidden))

        return send

    def _speak(self, request: StageRequest, input_ids: Any, emit: Emit) -> None:
        """Teacher-force ``request.text_to_speak`` as the assistant turn: what generate() would have produced
        had it sampled exactly these tokens, then <|im_end|> (whose own hidden state, as in
        generate(), is never computed)."""
        import torch

        reply = self.tokenizer.encode(request.text_to_speak or "", add_special_tokens=False)
        if not reply:
            raise InvalidStageInput("input: the text to speak is empty", "input")
        prompt_len = int(input_ids.shape[1])
        if prompt_len + len(reply) >= self.context_len:
            raise InvalidStageInput(
                f"input: {len(reply)} tokens to speak do not fit the model's context of {self.context_len} tokens",
                "input",
            )
        usage = Usage(prompt_tokens=prompt_len, completion_tokens=len(reply) + 1)
        if not request.wants_handoff:  # nothing downstream: the hidden states of the reply are not needed
            emit(("final", request.text_to_speak, FinishReason.STOP, usage, None, []))
            return
        sequence = torch.cat([input_ids, torch.tensor([reply], dtype=input_ids.dtype, device=input_ids.device)], 1)
        with torch.inference_mode():
            out = self.thinker(input_ids=sequence, attention_mask=torch.ones_like(sequence), output_hidden_states=True)
        steps = (out.hidden_states,)  # one "step" covering every position, like generate()'s prefill
        token_ids = [*sequence[0].tolist(), self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        payload = qwen3_omni.build_thinker2talker(
            token_ids=token_ids,
            prompt_len=prompt_len,
            embeds=qwen3_omni.thinker_states(steps, 0),
            hidden=qwen3_omni.thinker_states(steps, self.accept_layer),
            tts_embeds=self.tts_embeds,
            accept_hidden_layer=self.accept_layer,
        )
        emit(("final", request.text_to_speak, FinishReason.STOP, usage, payload, []))

    def _handoff(self, out: Any, prompt_len: int, kept: int, rope: dict[str, Any]) -> HandoffPayload:
        # The talker speaks only what the client sees: tokens from a stop string on are dropped.
        rows = min(prompt_len + kept, sum(step[0].shape[1] for step in out.hidden_states))
        return qwen3_omni.build_thinker2talker(
            token_ids=out.sequences[0, : prompt_len + kept].tolist(),
            prompt_len=prompt_len,
            embeds=qwen3_omni.thinker_states(out.hidden_states, 0)[:rows],
            hidden=qwen3_omni.thinker_states(out.hidden_states, self.accept_layer)[:rows],
            tts_embeds=self.tts_embeds,
            accept_hidden_layer=self.accept_layer,
            rope=rope,
        )


class _Reply:
    """The reply as ``generate()`` streams it (its streamer): each token into the text, the tool calls apart, and a
    delta emitted per token with the usage so far."""

    def __init__(
        self, prompt_len: int, text: _TextStream, calls: ToolCallStream | None, recorder: Any, emit: Emit
    ) -> None:
        self.prompt_len, self.text, self.calls, self.recorder, self.emit = prompt_len, text, calls, recorder, emit
        self.generated: list[int] = []
        self._prompt_seen = False

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_len, completion_tokens=len(self.generated))

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate() first hands the streamer the prompt
            self._prompt_seen = True
            return
        token = int(value.reshape(-1)[0])
        self.generated.append(token)
        piece, found = self.text.add(token), list[ToolCallDelta]()
        if self.calls is not None:  # the client gets the reply without its calls, the calls apart
            piece, found = self.calls.push(piece, [token], False)
        logprob = self.recorder.token(token) if self.recorder is not None else None
        self.emit(("delta", piece, [token], self.usage(), logprob, found))

    def end(self) -> None:
        pass

    def finish_reason(self, eos: list[int], cancelled: bool) -> FinishReason:
        if self.text.stop_at is not None:
            return FinishReason.STOP
        if cancelled:
            return FinishReason.ABORT
        return FinishReason.STOP if self.generated and self.generated[-1] in eos else FinishReason.LENGTH


class _RowGate:
    """The thinker's streamed rows on their way to the talker: a reply row goes once its token is spoken.

    The prompt's rows go at once. Reply row ``r`` is generated token ``r``'s; with tool calling it goes
    only once :attr:`ToolCallStream.spoken` covers that token, so the talker never gets a tool call's
    rows, nor text that may still turn out to open one (a parser holding back a partial tag); rows
    never confirmed are dropped at the end. Without tool calling every row goes as it is computed.
    """

    def __init__(self, calls: ToolCallStream | None, emit: Emit, usage: Callable[[], Usage]):
        self.calls = calls
        self.emit = emit
        self.usage = usage
        self.held: list[HandoffPayload] = []  # reply rows chunks not sent yet, in order
        self.sent = 0  # reply rows sent

    def prompt(self, payload: HandoffPayload) -> None:
        self.emit(("rows", payload, self.usage()))

    def reply(self, chunk: HandoffPayload) -> None:
        self.held.append(chunk)
        self.release()

    def release(self) -> None:
        """Send the held rows of the tokens spoken by now."""
        ready: list[HandoffPayload] = []
        while self.held and (self.calls is None or self.sent + _rows(self.held[0]) <= self.calls.spoken):
            chunk = self.held.pop(0)
            self.sent += _rows(chunk)
            ready.append(chunk)
        if ready:
            self.emit(("rows", qwen3_omni.merge_thinker_chunks(ready), self.usage()))


def _rows(chunk: HandoffPayload) -> int:
    return int(chunk.tensors["embeds"].shape[0])
