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
import time
from collections.abc import AsyncIterator
from typing import Any

from omni_serve.engines.vllm_omni.engine import VllmOmniEngine
from omni_serve.engines.vllm_omni.mapping import finish_reason, lookup, multimodal_output
from omni_serve.models import vllm_omni_handoffs as handoffs
from omni_serve.payload import HandoffPayload
from omni_serve.types import EngineError, InvalidStageInput, StageOutput, StageRequest, Usage

# How often the end markers of streamed requests are looked for; how long one is waited for when its
# request was aborted (vLLM-Omni sends one then only if the request's end was already on its way).
MARKER_POLL_S, UNSURE_MARKER_WAIT_S = 0.05, 60.0


class TalkerEngine(VllmOmniEngine):
    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self._speakers: dict[str, int] = {}  # lower-case speaker name -> speaker id, from the checkpoint
        self._connector: Any = None
        self._markers: _EndMarkers | None = None

    async def _setup(self, hf_config: Any) -> None:
        talker_config = getattr(hf_config, "talker_config", None)
        self._speakers = {k.lower(): int(v) for k, v in (getattr(talker_config, "speaker_id", None) or {}).items()}
        if self.stream_input:  # the connector this replica writes the thinker's chunks to (see the module doc)
            from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
                OmniChunkTransferAdapter,
            )

            self._connector = OmniChunkTransferAdapter.create_connector(self._vllm_config.model_config)
            self._markers = _EndMarkers(self._connector, self.args.stage_id)

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
        async for output in self._request(request, prompt, params, feed=feed.run if feed else None):
            if output.finished and feed is not None:
                feed.engine_finished = True  # so its EngineCore sends the request's end marker
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

    async def _streamed(self, chunks: AsyncIterator[HandoffPayload], voice: str | None) -> tuple[dict[str, Any], _Feed]:
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
        return prompt, _Feed(self, self._all_steps(steps, chunks), voice)

    def shutdown(self) -> None:
        # What this replica wrote and nobody read (a request cut short by the shutdown), and the end markers
        # still expected: unlinked with the engine, not left in /dev/shm.
        if self._markers is not None:
            self._markers.close()
        if self._connector is not None:
            self._connector.close()
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


class _Feed:
    """One streamed call's input: writes each of the thinker's chunks (``steps``) to the EngineCore's connector
    under the key its chunk adapter polls, for as long as the engine request runs (:meth:`run`, beside it).

    Every segment it wrote goes when the request ends: the engine unlinks what it read, the feed what it
    did not (a put on its way when the request ended is waited for first: its thread would create the
    segment after the unlink otherwise). The request's end marker, which the talker's adapter sends on
    for the stage after it, is read by the replica (:class:`_EndMarkers`).
    """

    def __init__(self, talker: TalkerEngine, steps: AsyncIterator[HandoffPayload], voice: str | None):
        self.talker, self.steps, self.voice = talker, steps, voice
        self.engine_finished = False  # the engine finished the request (set by the call): an end marker comes

    async def run(self, engine_request_id: str) -> None:
        talker = self.talker
        upstream, stage = str(talker.args.stage_id - 1), str(talker.args.stage_id)  # the adapter reads stage - 1's
        keys: list[str] = []
        put: asyncio.Future[Any] | None = None
        try:
            async for step in self.steps:
                payload = handoffs.from_handoff(step)
                decode = payload.get("embed", {}).get("decode")
                if decode is not None:
                    # vLLM-Omni's async-chunk decode step projects the thinker's row without casting it to
                    # the talker's dtype (its prefill casts the thinker's states to bf16 itself); on GPUs
                    # both stages run bf16, here the thinker runs float32. No upstream issue found.
                    payload["embed"]["decode"] = decode.to(talker._vllm_config.model_config.dtype)
                if self.voice:
                    payload["speaker"] = self.voice
                key = f"{engine_request_id}_{upstream}_{len(keys)}"
                keys.append(key)
                put = asyncio.ensure_future(asyncio.to_thread(talker._connector.put, upstream, stage, key, payload))
                ok, _, _ = await asyncio.shield(put)
                if not ok:
                    raise EngineError(f"stage {talker.stage_name}: writing the thinker's chunk {key} failed")
            # Every chunk is written; the engine request may still read them: hold their keys until
            # the request ends (the engine request's end cancels this feed).
            await asyncio.Future()
        except (asyncio.CancelledError, EngineError):
            raise
        except Exception as err:  # the channel's ProducerFailed (the thinker failed), or a lost channel
            raise EngineError(f"the talker's input stream failed ({type(err).__name__})") from err
        finally:
            if put is not None and not put.done():  # cancelled mid-put: its segment exists once the put is done
                await asyncio.wait([put])
            for key in keys:  # chunks the engine never read (aborted, or it stopped speaking first)
                talker._connector.cleanup(key)
            if talker._markers is not None:
                talker._markers.expect(f"{engine_request_id}_{stage}_0", sure=self.engine_finished)


class _EndMarkers:
    """The end markers of this replica's streamed requests, read (which unlinks them) as they come.

    vLLM-Omni's chunk adapter sends every request it finished an end marker for the stage after the
    talker (its own pipeline's code2wav reads it; here code2wav takes its chunks from this replica, so
    the replica reads the marker). It comes from the adapter's save thread, some time after the
    request's last output: a marker a finished request is due is waited for however long it takes. An
    aborted request gets one only if its end was already on its way to that thread: its marker is
    waited for :data:`UNSURE_MARKER_WAIT_S`, then unlinked in case it comes later. One task sweeps them
    all while any is due; :meth:`close` (the engine's shutdown) unlinks whatever is still due.
    """

    def __init__(self, connector: Any, stage_id: int):
        self._connector = connector
        self._stages = (str(stage_id), str(stage_id + 1))
        self._due: dict[str, float] = {}  # marker key -> until when it is waited for (inf: until it comes)
        self._sweep: asyncio.Task[None] | None = None

    def expect(self, key: str, *, sure: bool) -> None:
        self._due[key] = float("inf") if sure else time.monotonic() + UNSURE_MARKER_WAIT_S
        if self._sweep is None or self._sweep.done():
            self._sweep = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._due:
            for key, until in list(self._due.items()):
                if self._connector.get(*self._stages, key) is not None:  # read: the connector unlinked it
                    del self._due[key]
                elif time.monotonic() > until:
                    self._connector.cleanup(key)  # came later than any marker should: not left behind
                    del self._due[key]
            await asyncio.sleep(MARKER_POLL_S)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        for key in list(self._due):
            self._connector.cleanup(key)
        self._due.clear()
