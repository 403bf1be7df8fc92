"""The talker role of a vLLM-Omni stage: the thinker's handoff -> codec frames for code2wav.

Its input comes whole (the thinker's final handoff, in the prompt), or streamed (the stage's
``stream_input``): the thinker's async chunks as they come, which this replica writes to its
EngineCore's shared-memory connector under the keys vLLM-Omni's chunk adapter polls, so the
talker's scheduler runs vLLM-Omni's own async-chunk path (each decoding step waits for the chunk it
reads). Frames go downstream whole at the end, or, with ``codec_chunk``, in chunks as vLLM-Omni's
async-chunk connector cuts them (each chunk its own code2wav call).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from omni_serve.engines.vllm_omni.engine import VllmOmniEngine
from omni_serve.engines.vllm_omni.mapping import finish_reason, lookup, multimodal_output
from omni_serve.models import vllm_omni_handoffs as handoffs
from omni_serve.payload import HandoffPayload
from omni_serve.types import EngineError, InvalidStageInput, StageOutput, StageRequest, Usage

MARKER_POLL_S, MARKER_POLLS = 0.05, 200  # the end marker of a streamed request: looked for over 10 s


class TalkerEngine(VllmOmniEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self._speakers: dict[str, int] = {}  # lower-case speaker name -> speaker id, from the checkpoint
        self._drains: set[asyncio.Task[None]] = set()  # end-marker polls (_drain_marker), cancelled at shutdown

    async def _setup(self, hf_config: Any) -> None:
        talker_config = getattr(hf_config, "talker_config", None)
        self._speakers = {k.lower(): int(v) for k, v in (getattr(talker_config, "speaker_id", None) or {}).items()}
        self._connector: Any = None
        if self.stream_input:  # the connector this replica writes the thinker's chunks to (see the module doc)
            from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
                OmniChunkTransferAdapter,
            )

            self._connector = OmniChunkTransferAdapter.create_connector(self._vllm_config.model_config)

    def voices(self) -> list[str]:
        """The speaker names (lower case, as vLLM-Omni matches them)."""
        return sorted(self._speakers)

    def _voice(self, voice: str | None) -> str | None:
        if voice is None:
            return None
        if voice.lower() not in self._speakers:
            raise InvalidStageInput(f"voice: unknown voice {voice!r}; valid voices: {sorted(self._speakers)}")
        return voice.lower()

    async def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]:
        pipeline = self.args.pipeline
        voice = self._voice(request.voice)
        feed = None
        if self.stream_input:  # its EngineCore reads chunks only: a whole handoff is a stream of one
            chunks = request.handoff_stream if request.handoff_stream is not None else _one(self._handoff_in(handoff))
            prompt, feed = await self._streamed(chunks, voice)
        else:
            whole = self._handoff_in(handoff)
            prompt = handoffs.talker_prompt(pipeline, whole, request_id=request.request_id, voice=voice)
        if not prompt["prompt_token_ids"]:  # the EngineCore would die on it (assert num_new_tokens > 0)
            raise EngineError(f"stage {self.stage_name}: the thinker's handoff has no assistant turn to speak")
        # DELTA: vLLM-Omni keeps the codec frames as a list of per-step tensors until the end.
        # A frame's residual code groups come with the next step, so the last sampled token never
        # gets a frame: one more step yields max_tokens whole frames (as in the transformers family).
        params = self._params(request, "DELTA", max_tokens=request.sampling.max_tokens + 1)
        # Not reproducible per seed: vLLM-Omni 0.30's Qwen3-Omni code predictor samples the residual
        # code groups from the worker's global RNG (its talker_mtp ignores the per-request generator the
        # runner builds from extra_args["tts_local_seed"], which only Qwen3-TTS uses). No upstream issue found.
        chunker = None
        if self.args.codec_chunk is not None:
            chunker = handoffs.AsyncChunkTransfer(
                pipeline,
                request.request_id,
                chunk_frames=self.args.codec_chunk.chunk_frames,
                left_context_frames=self.args.codec_chunk.left_context_frames,
                initial_chunk_frames=self.args.codec_chunk.initial_chunk_frames,
                stop_token_ids=list(params.stop_token_ids or ()),
            )
        rows = handoffs.NewRows(placeholders=True)
        frames: list[Any] = []
        token_ids: list[int] = []
        async for output in self._request(request, prompt, params, feed=feed):
            completion = output.outputs[0]
            token_ids.extend(completion.token_ids)
            fresh = rows.new(lookup(multimodal_output(output), "codes.audio"))
            if fresh is not None:
                if chunker is None:
                    frames.append(fresh)
                else:
                    for row in range(len(fresh)):
                        payload = chunker.push(fresh[row : row + 1], finished=False)
                        if payload is not None:
                            yield StageOutput(stage=self.stage_name, handoff=payload)
            if not output.finished:
                continue
            import torch

            if chunker is not None:
                final = chunker.push(torch.zeros((0, 0), dtype=torch.long), finished=True)
            else:
                final = handoffs.talker_handoff(
                    pipeline,
                    request_id=request.request_id,
                    output_token_ids=token_ids,
                    codes=torch.cat(frames) if frames else None,
                )
            yield StageOutput(
                stage=self.stage_name,
                handoff=final,
                finished=True,
                finish_reason=finish_reason(completion.finish_reason),
                usage=Usage(prompt_tokens=len(prompt["prompt_token_ids"]), completion_tokens=len(token_ids)),
            )

    async def _streamed(
        self, chunks: AsyncIterator[HandoffPayload], voice: str | None
    ) -> tuple[dict[str, Any], Callable[[str], Coroutine[Any, Any, None]]]:
        """A streamed call's placeholder prompt (from its first chunk), and the feed that writes every chunk
        to the EngineCore's connector under the engine request's id, as vLLM-Omni's async-chunk prewarm
        and connector do."""
        first = await anext(chunks, None)
        if first is None:
            raise InvalidStageInput(f"stage {self.stage_name}: the thinker's stream ended before its first chunk")
        try:
            steps = self._steps(first)
            prompt = handoffs.talker_chunk_prompt(steps[0])
        except (KeyError, ValueError) as err:
            raise InvalidStageInput(f"stage {self.stage_name}: {err}") from None
        upstream = str(self.args.stage_id - 1)  # the adapter reads the chunks of stage_id - 1

        async def feed(engine_request_id: str) -> None:
            keys: list[str] = []
            try:
                async for step in self._all_steps(steps, chunks):
                    payload = handoffs.from_handoff(step)
                    decode = payload.get("embed", {}).get("decode")
                    if decode is not None:
                        # vLLM-Omni's async-chunk decode step projects the thinker's row without casting it to
                        # the talker's dtype (its prefill casts the thinker's states to bf16 itself); on GPUs
                        # both stages run bf16, here the thinker runs float32. No upstream issue found.
                        payload["embed"]["decode"] = decode.to(self._vllm_config.model_config.dtype)
                    if voice:
                        payload["speaker"] = voice
                    key = f"{engine_request_id}_{upstream}_{len(keys)}"
                    keys.append(key)
                    ok, _, _ = await asyncio.to_thread(
                        self._connector.put, upstream, str(self.args.stage_id), key, payload
                    )
                    if not ok:
                        raise EngineError(f"stage {self.stage_name}: writing the thinker's chunk {key} failed")
                # Every chunk is written; the engine request may still read them: hold their keys until
                # the request ends (the engine request's end cancels this feed).
                await asyncio.Future()
            except (asyncio.CancelledError, EngineError):
                raise
            except Exception as err:  # the channel's ProducerFailed (the thinker failed), or a lost channel
                raise EngineError(f"the talker's input stream failed ({type(err).__name__})") from err
            finally:  # chunks the engine never read (aborted, or it stopped speaking first)
                for key in keys:
                    self._connector.cleanup(key)
                self._drain_marker(engine_request_id)

        return prompt, feed

    def _drain_marker(self, engine_request_id: str) -> None:
        """Read the end marker a streamed request's EngineCore sends on, so its shared memory is unlinked.

        vLLM-Omni's chunk adapter sends every finished request's end marker to the stage after the
        talker (its own pipeline's code2wav reads it); here code2wav takes its chunks from this replica,
        so the replica reads the marker. It comes from the adapter's background thread, shortly after
        the request's last output (aborted requests may send none: the wait is bounded).
        """
        stage = self.args.stage_id
        key = f"{engine_request_id}_{stage}_0"  # the talker's adapter has no payload to send: only the marker

        async def drain() -> None:
            for _ in range(MARKER_POLLS):
                if self._connector.get(str(stage), str(stage + 1), key) is not None:
                    return
                await asyncio.sleep(MARKER_POLL_S)

        task = asyncio.get_running_loop().create_task(drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    def shutdown(self) -> None:
        # The marker polls outlive their requests by up to 10 s: stopped with the engine, not left
        # pending on a loop that closes ("Task was destroyed but it is pending!").
        for task in list(self._drains):
            task.cancel()
        super().shutdown()

    def _steps(self, chunk: HandoffPayload) -> list[HandoffPayload]:
        """The connector chunks in one input chunk (a whole handoff: all of them)."""
        if chunk.kind == handoffs.kind(self.args.pipeline, handoffs.THINKER2TALKER):
            hf_config = self._vllm_config.model_config.hf_config
            chunk = handoffs.whole_as_chunks(self.args.pipeline, chunk, hf_config)
        return handoffs.chunk_steps(chunk)

    async def _all_steps(
        self, first: list[HandoffPayload], rest: AsyncIterator[HandoffPayload]
    ) -> AsyncIterator[HandoffPayload]:
        for step in first:
            yield step
        async for chunk in rest:
            for step in self._steps(chunk):
                yield step


async def _one(handoff: HandoffPayload) -> AsyncIterator[HandoffPayload]:
    yield handoff
