"""The talker stage: the thinker's handoff (whole or streamed) -> codec chunks for code2wav."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from queue import Empty, SimpleQueue
from typing import Any

import numpy as np

from omni_serve.engines.transformers.sampling import end_ids, generation_config, seed, stopping
from omni_serve.engines.transformers.worker import RNG_LOCK, Emit, Failure, HFEngine
from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.models import codec, qwen3_omni
from omni_serve.payload import HandoffPayload
from omni_serve.types import FinishReason, StageOutput, StageRequest, Usage


class TalkerEngine(HFEngine):
    """thinker2talker handoff -> codec chunks, streamed as the frames are generated."""

    def _setup(self, model: Any) -> None:
        qwen3_omni.give_talker_the_audio_config(model)
        self.talker = model.talker
        self.suppress_tokens = qwen3_omni.talker_suppress_tokens(self.config)
        self.context_len = int(self.config.talker_config.text_config.max_position_embeddings)

    def voices(self) -> list[str]:
        return qwen3_omni.speakers(self.config)

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        try:
            speaker = qwen3_omni.speaker_id(self.config, request.voice, self.args.default_voice)
        except KeyError as exc:
            raise InvalidStageInput(f"stage {self.stage_name}: {exc.args[0]}", "voice") from None
        chunks: AsyncIterator[HandoffPayload] | None = request.handoff_stream  # a streamed call
        first = await anext(chunks, None) if chunks is not None else handoff
        if first is None or first.kind != qwen3_omni.THINKER2TALKER:
            raise InvalidStageInput(f"stage {self.stage_name}: the talker needs a {qwen3_omni.THINKER2TALKER} handoff")
        thinker = qwen3_omni.ThinkerRows(first, self.config.im_start_token_id)
        # A streamed handoff: the rest of the reply's rows come while the talker runs. It starts once
        # the reply's first row is here, and each decoding step waits for the row it adds (the job's
        # `Rows`), so it never runs ahead of the thinker.
        rows = _Rows()
        if chunks is not None and not thinker.whole:
            while not thinker.can_start() and (chunk := await anext(chunks, None)) is not None:
                thinker.add(chunk)
            if not thinker.can_start():  # the reply ended before its first row: like a whole handoff
                rows.end()
        else:
            rows.end()
        feeding = asyncio.create_task(rows.feed(chunks)) if chunks is not None and not rows.ended else None

        def job(emit: Emit, cancelled: threading.Event) -> None:
            self._generate(request, thinker, rows, speaker, emit, cancelled)

        try:
            async with contextlib.aclosing(self._run(request.request_id, job)) as batches:
                async for batch in batches:
                    for item in batch:  # one output per chunk: each becomes its own code2wav call
                        if item[0] == "chunk":
                            yield StageOutput(stage=self.stage_name, handoff=item[1])
                        else:
                            _, last_chunk, reason, usage = item
                            yield StageOutput(
                                stage=self.stage_name,
                                handoff=last_chunk,
                                finished=True,
                                finish_reason=reason,
                                usage=usage,
                            )
        finally:
            if feeding is not None:
                feeding.cancel()
                with contextlib.suppress(BaseException):
                    await feeding

    def _generate(
        self,
        request: StageRequest,
        thinker: qwen3_omni.ThinkerRows,
        rows: _Rows,
        speaker: int,
        emit: Emit,
        cancelled: threading.Event,
    ) -> None:
        import torch

        s = request.sampling
        a = self.args
        chunker = codec.CodecChunker(a.codec_first_chunk_frames, a.codec_chunk_frames, a.codec_left_context_frames)
        with torch.inference_mode():
            inputs = qwen3_omni.talker_inputs(thinker, self.talker, self.config, speaker)
        if inputs is None:  # the thinker said nothing: no speech
            emit(("final", None, FinishReason.STOP, Usage()))
            return
        # Frames it may make: max_tokens, within its context (a row per step is allocated up front, so a
        # request's max_tokens alone must not size it). One row per step the talker may take (HF's talker
        # runs frames + 1 steps).
        frames = max(1, min(s.max_tokens, self.context_len - int(inputs.inputs_embeds.shape[1]) - 1))
        trailing = qwen3_omni.TrailingText(inputs, frames + 2)

        def on_step(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            # Each decoding step's forward carries the residual codes of the token sampled one step
            # earlier (HF's hook for them): together with it, one complete frame of all code groups.
            codes = output.hidden_states[-1]
            if codes is not None:
                for chunk in chunker.push(codes[0].cpu().numpy()):
                    emit(("chunk", chunk))

        steps = 0

        def next_row_ready() -> None:
            # After step `steps` (the prefill is step 0), HF's next step adds trailing row `steps - 1`.
            nonlocal steps
            steps += 1
            rows.wait(trailing, steps - 1, self.talker, cancelled)

        ends = end_ids([self.config.talker_config.codec_eos_token_id], set(s.stop_token_ids), s.ignore_eos)
        hook = self.talker.register_forward_hook(on_step, with_kwargs=True)
        try:
            with RNG_LOCK, torch.inference_mode():
                torch.manual_seed(seed(s))
                sequences = self.talker.generate(
                    **inputs.as_kwargs(trailing),
                    generation_config=generation_config(
                        s,
                        # HF's talker never gives the last sampled token residual codes: one more step
                        # yields that many complete frames.
                        max_new_tokens=frames + 1,
                        eos_token_id=ends,
                        pad_token_id=self.config.talker_config.codec_eos_token_id,  # batch of one: never padded
                        suppress_tokens=self.suppress_tokens,
                        output_hidden_states=True,  # the residual codes travel in the hidden states
                        return_dict_in_generate=True,
                    ),
                    stopping_criteria=stopping(cancelled, self.args.min_step_s, before_next=next_row_ready),
                ).sequences
        finally:
            hook.remove()
        last = int(sequences[0, -1]) if sequences.shape[1] else None
        if cancelled.is_set():
            reason = FinishReason.ABORT
        elif last in ends:
            reason = FinishReason.STOP
        else:
            reason = FinishReason.LENGTH
        rest = chunker.flush()
        for chunk in rest[:-1]:
            emit(("chunk", chunk))
        usage = Usage(prompt_tokens=int(inputs.inputs_embeds.shape[1]), completion_tokens=chunker.num_frames)
        emit(("final", rest[-1] if rest else None, reason, usage))


class _Rows:
    """A streamed thinker handoff's rows on their way from the event loop to the talker's job thread.

    :meth:`feed` (a task on the loop) queues each chunk's rows as it arrives, then the end (or the
    producer's failure); :meth:`wait` (in the job, between decoding steps) projects what has come into
    the talker's :class:`TrailingText` until the row the next step adds is there. A failed producer
    fails the talker's call: its audio would be missing the reply's end.
    """

    _END = object()

    def __init__(self) -> None:
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self.ended = False

    def end(self) -> None:
        self.ended = True
        self._queue.put(self._END)

    async def feed(self, chunks: AsyncIterator[HandoffPayload]) -> None:
        try:
            async for chunk in chunks:
                self._queue.put(qwen3_omni.reply_rows(chunk))
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self._queue.put(Failure(err))
            return
        self.end()

    def wait(self, trailing: qwen3_omni.TrailingText, step: int, talker: Any, cancelled: threading.Event) -> None:
        import torch

        while not trailing.ready(step) and not cancelled.is_set():
            try:
                item = self._queue.get(timeout=0.05)  # polls the abort flag meanwhile
            except Empty:
                continue
            if item is self._END:
                trailing.finish()
            elif isinstance(item, Failure):
                raise EngineError(f"the talker's input stream failed ({type(item.exc).__name__})") from item.exc
            else:
                with torch.inference_mode():
                    rows = torch.from_numpy(np.array(item, copy=True))[None].to(talker.device)
                    trailing.extend(qwen3_omni.project_rows(talker, rows.to(talker.dtype)))
