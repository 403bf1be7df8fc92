"""A stage reading its upstream's async chunks (its graph's ``stream_input``), as vLLM-Omni's async-chunk mode does.

Its EngineCore is built with ``async_chunk`` and a receive-only shared-memory connector
(:func:`omni_serve.engines.vllm_omni.args.stage_config`). For each call the replica submits the
placeholder prompt vLLM-Omni's async-chunk prewarm submits, and writes every chunk as it comes under
the key the stage's chunk adapter polls (``{engine request id}_{upstream stage}_{n}``), so vLLM-Omni's
scheduler holds each decoding step until its chunk is there. The shared memory is the hop between
the replica and its own EngineCore only: between stages the chunks travel through the object store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from omni_serve.models.vllm_omni.edges import chunk_steps, kind
from omni_serve.models.vllm_omni.hooks import StageHooks
from omni_serve.models.vllm_omni.payload import from_handoff
from omni_serve.payload import HandoffPayload
from omni_serve.types import EngineError, InvalidStageInput

MARKER_POLL_S, MARKER_POLLS = 0.05, 200  # the end marker of a streamed request: looked for over 10 s

Feed = Callable[[str], Coroutine[Any, Any, None]]


class StreamedInput:
    """One stage's connector to its EngineCore, and the feeds that write each call's chunks to it."""

    def __init__(self, stage_name: str, stage_id: int, upstream: Any, hooks: StageHooks, vllm_config: Any):
        from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
            OmniChunkTransferAdapter,
        )

        self.stage_name = stage_name
        self.stage_id = stage_id
        self.upstream = upstream  # the upstream stage's StagePipelineConfig
        self.hooks = hooks
        self.vllm_config = vllm_config
        self.connector = OmniChunkTransferAdapter.create_connector(vllm_config.model_config)
        self._drains: set[asyncio.Task[None]] = set()  # end-marker polls (drain_marker), cancelled at shutdown

    async def prompt_and_feed(
        self, chunks: AsyncIterator[HandoffPayload], voice: str | None
    ) -> tuple[dict[str, Any], Feed]:
        """A streamed call's placeholder prompt (from its first chunk), and the feed that writes every chunk
        to the EngineCore's connector under the engine request's id, as vLLM-Omni's async-chunk prewarm and
        connector do."""
        first = await anext(chunks, None)
        if first is None:
            raise InvalidStageInput(f"stage {self.stage_name}: the upstream's stream ended before its first chunk")
        if self.hooks.chunk_prompt is None:
            raise EngineError(f"stage {self.stage_name}: no placeholder prompt for streamed input is known")
        try:
            steps = self._steps(first)
            prompt = self.hooks.chunk_prompt(steps[0])
        except (KeyError, ValueError) as err:
            raise InvalidStageInput(f"stage {self.stage_name}: {err}") from None
        upstream = str(self.upstream.stage_id)  # the adapter reads the chunks of its input source
        dtype = self.vllm_config.model_config.dtype

        async def feed(engine_request_id: str) -> None:
            keys: list[str] = []
            try:
                async for step in self._all_steps(steps, chunks):
                    payload = from_handoff(step)
                    if self.hooks.chunk_payload is not None:
                        payload = self.hooks.chunk_payload(payload, dtype)
                    if voice:
                        payload["speaker"] = voice
                    key = f"{engine_request_id}_{upstream}_{len(keys)}"
                    keys.append(key)
                    ok, _, _ = await asyncio.to_thread(self.connector.put, upstream, str(self.stage_id), key, payload)
                    if not ok:
                        raise EngineError(f"stage {self.stage_name}: writing the upstream's chunk {key} failed")
                # Every chunk is written; the engine request may still read them: hold their keys until
                # the request ends (the engine request's end cancels this feed).
                await asyncio.Future()
            except (asyncio.CancelledError, EngineError):
                raise
            except Exception as err:  # the channel's ProducerFailed (the upstream failed), or a lost channel
                raise EngineError(f"stage {self.stage_name}: its input stream failed ({type(err).__name__})") from err
            finally:  # chunks the engine never read (aborted, or it stopped first)
                for key in keys:
                    self.connector.cleanup(key)
                self.drain_marker(engine_request_id)

        return prompt, feed

    def drain_marker(self, engine_request_id: str) -> None:
        """Read the end marker a streamed request's EngineCore sends on, so its shared memory is unlinked.

        vLLM-Omni's chunk adapter sends every finished request's end marker to the next stage (its own
        pipeline's downstream stage reads it); here the downstream stage takes its input from this replica,
        so the replica reads the marker. It comes from the adapter's background thread, shortly after the
        request's last output (aborted requests may send none: the wait is bounded).
        """
        stage = self.stage_id
        key = f"{engine_request_id}_{stage}_0"  # the adapter has no payload to send: only the marker

        async def drain() -> None:
            for _ in range(MARKER_POLLS):
                if self.connector.get(str(stage), str(stage + 1), key) is not None:
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

    def _steps(self, chunk: HandoffPayload) -> list[HandoffPayload]:
        """The connector chunks in one input item (a whole handoff: all of them)."""
        if chunk.kind != kind(self.upstream.async_chunk_process_next_stage_input_func):
            if self.hooks.whole_as_chunks is None:
                raise ValueError(f"{chunk.kind}: a whole handoff, and this stage reads chunks only")
            chunk = self.hooks.whole_as_chunks(chunk, self.vllm_config.model_config.hf_config)
        return chunk_steps(chunk)

    async def _all_steps(
        self, first: list[HandoffPayload], rest: AsyncIterator[HandoffPayload]
    ) -> AsyncIterator[HandoffPayload]:
        for step in first:
            yield step
        async for chunk in rest:
            for step in self._steps(chunk):
                yield step
