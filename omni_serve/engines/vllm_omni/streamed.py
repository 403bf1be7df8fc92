"""A stage reading its upstream's async chunks (its graph's ``stream_input``), as vLLM-Omni's async-chunk mode does.

Its EngineCore is built with ``async_chunk`` and a receive-only shared-memory connector
(:func:`omni_serve.engines.vllm_omni.args.stage_config`). For each call the replica submits the
placeholder prompt vLLM-Omni's async-chunk prewarm submits, and writes every chunk as it comes under
the key the stage's chunk adapter polls (``{engine request id}_{upstream stage}_{n}``), so vLLM-Omni's
scheduler holds each decoding step until its chunk is there. The shared memory is the hop between
the replica and its own EngineCore only: between stages the chunks travel through the object store.
No ``/dev/shm`` segment outlives its request (:class:`StreamedFeed`, :class:`_EndMarkers`), nor the
engine (:meth:`StreamedInput.shutdown`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator
from typing import Any

from omni_serve.exceptions import EngineError, InvalidStageInput
from omni_serve.models.vllm_omni.edges import chunk_steps, kind
from omni_serve.models.vllm_omni.hooks import StageHooks
from omni_serve.models.vllm_omni.payload import from_handoff
from omni_serve.payload import HandoffPayload

# How often the end markers of streamed requests are looked for; how long one is waited for when its
# request was aborted (vLLM-Omni sends one then only if the request's end was already on its way).
MARKER_POLL_S, UNSURE_MARKER_WAIT_S = 0.05, 60.0


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
        self.markers = _EndMarkers(self.connector, stage_id)
        # The feeds' puts run in threads of their own, so that shutdown can wait for one on its way: its thread
        # creates the segment, and registers it with the connector, after the connector's close otherwise.
        self.puts = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{stage_name}-chunks")

    async def prompt_and_feed(
        self, chunks: AsyncIterator[HandoffPayload], voice: str | None
    ) -> tuple[dict[str, Any], StreamedFeed]:
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
        return prompt, StreamedFeed(self, self._all_steps(steps, chunks), voice)

    def shutdown(self) -> None:
        # What this replica wrote and nobody read (a request cut short by the shutdown), and the end markers
        # still expected: unlinked with the engine, not left in /dev/shm.
        self.markers.close()
        self.puts.shutdown(wait=True)  # a put on its way ends first (a later one is refused: its feed fails)
        self.connector.close()

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


class StreamedFeed:
    """One streamed call's input: writes each upstream chunk (``steps``) to the EngineCore's connector under
    the key its chunk adapter polls, for as long as the engine request runs (:meth:`run`, beside it).

    Every segment it wrote goes when the request ends: the engine unlinks what it read, the feed what it
    did not (a put on its way when the request ended is waited for first: its thread would create the
    segment after the unlink otherwise). The request's end marker, which the stage's adapter sends on
    for the stage after it, is read by the replica (:class:`_EndMarkers`).
    """

    def __init__(self, streamed: StreamedInput, steps: AsyncIterator[HandoffPayload], voice: str | None):
        self.streamed, self.steps, self.voice = streamed, steps, voice
        self.engine_finished = False  # the engine finished the request (set by the call): an end marker comes

    async def run(self, engine_request_id: str) -> None:
        streamed = self.streamed
        connector, dtype = streamed.connector, streamed.vllm_config.model_config.dtype
        # The adapter reads the chunks of its input source.
        upstream, stage = str(streamed.upstream.stage_id), str(streamed.stage_id)
        keys: list[str] = []
        put: asyncio.Future[Any] | None = None
        loop = asyncio.get_running_loop()
        try:
            async for step in self.steps:
                payload = from_handoff(step)
                if streamed.hooks.chunk_payload is not None:
                    payload = streamed.hooks.chunk_payload(payload, dtype)
                if self.voice:
                    payload["speaker"] = self.voice
                key = f"{engine_request_id}_{upstream}_{len(keys)}"
                keys.append(key)
                put = loop.run_in_executor(streamed.puts, connector.put, upstream, stage, key, payload)
                ok, _, _ = await asyncio.shield(put)
                if not ok:
                    raise EngineError(f"stage {streamed.stage_name}: writing the upstream's chunk {key} failed")
            # Every chunk is written; the engine request may still read them: hold their keys until
            # the request ends (the engine request's end cancels this feed).
            await asyncio.Future()
        except (asyncio.CancelledError, EngineError):
            raise
        except Exception as err:  # the channel's ProducerFailed (the upstream failed), or a lost channel
            raise EngineError(f"stage {streamed.stage_name}: its input stream failed ({type(err).__name__})") from err
        finally:
            if put is not None and not put.done():  # cancelled mid-put: its segment exists once the put is done
                await asyncio.wait([put])
            for key in keys:  # chunks the engine never read (aborted, or it stopped first)
                connector.cleanup(key)
            streamed.markers.expect(f"{engine_request_id}_{stage}_0", sure=self.engine_finished)


class _EndMarkers:
    """The end markers of this replica's streamed requests, read (which unlinks them) as they come.

    vLLM-Omni's chunk adapter sends every request it finished an end marker for the next stage (its own
    pipeline's downstream stage reads it; here the downstream stage takes its input from this replica, so
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
