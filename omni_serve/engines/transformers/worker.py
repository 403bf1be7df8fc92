"""What every stage of the family shares: the worker thread its model work runs on, loading, stats.

A call's job runs on the replica's one worker thread; what it emits travels back to the event loop
with ``call_soon_threadsafe`` and is read in batches (:meth:`HFEngine._run`). A call is tracked in
``self.calls`` by its cancel event, which the job's stopping criteria poll (abort sets it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any

from omni_serve.engines.base import PacedInProcess, StageEngine
from omni_serve.engines.transformers.args import TransformersEngineArgs
from omni_serve.exceptions import EngineDeadError, EngineError
from omni_serve.types import RequestId

logger = logging.getLogger(__name__)

# Sampling stages in one process (in-process tests, a co-located graph) take turns on the
# global torch RNG; in a deployment each replica has one engine and never waits here.
RNG_LOCK = threading.Lock()


class Worker:
    """One daemon thread running submitted callables in order."""

    def __init__(self, name: str):
        self._jobs: SimpleQueue[tuple[Callable[[], Any], Future] | None] = SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the awaiting side
                fut.set_exception(exc)


@dataclass
class Failure:
    exc: BaseException


END = object()
Emit = Callable[[Any], None]
# Outputs a job may have emitted that its stage has not taken; then it waits (and holds the worker,
# as a streamed talker waiting for its thinker's rows does): a talker at most this many codec chunks
# ahead of its stage, a thinker this many tokens.
MAX_UNTAKEN_OUTPUTS = 8


class HFEngine(PacedInProcess, StageEngine):
    """Loading, the worker thread and stats shared by the three stages; a call's job is tracked in
    ``self.calls`` by its cancel event, which the job's stopping criteria poll (abort sets it)."""

    def __init__(self, stage_name: str, engine_args: dict[str, Any]):
        super().__init__(stage_name, engine_args)
        self.args = TransformersEngineArgs.model_validate(engine_args)
        self._worker: Worker | None = None
        self._ready = False
        self._counts_lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._total = 0
        self._emitted = 0  # outputs its jobs emitted (tests: a job held back by its reader stops emitting)

    async def start(self) -> None:
        self._worker = Worker(f"{self.stage_name}-engine")
        t0 = time.perf_counter()
        await asyncio.wrap_future(self._worker.submit(self._load))
        self._ready = True
        logger.info(
            "stage %s: transformers engine (%s, model %s, %s, %d threads) ready in %.1f s",
            self.stage_name,
            self.args.model_stage,
            self.args.model,
            self.args.dtype,
            self.args.num_threads,
            time.perf_counter() - t0,
        )

    def _load(self) -> None:
        import torch
        from transformers import Qwen3OmniMoeForConditionalGeneration

        from omni_serve.checkpoints.tiny_omni import resolve_model

        torch.set_num_threads(self.args.num_threads)
        self.model_path = resolve_model(self.args.model)
        # The whole checkpoint is loaded and the other stages dropped: loading a sub-model class
        # directly mis-converts the talker's MoE expert weights in transformers 5.14. The thinker
        # skips building talker and code2wav.
        thinker_only = self.args.model_stage == "thinker"
        load_log = logging.getLogger("transformers.modeling_utils")
        quiet = _DropLoadReport()
        if thinker_only:  # its load report would list every talker/code2wav weight as "unexpected"
            load_log.addFilter(quiet)
        try:
            model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
                self.model_path, dtype=getattr(torch, self.args.dtype), enable_audio_output=not thinker_only
            ).eval()
        finally:
            load_log.removeFilter(quiet)
        self.config = model.config
        self._setup(model)

    def _setup(self, model: Any) -> None:
        raise NotImplementedError

    async def _abort(self, handles: list[threading.Event]) -> None:
        for cancelled in handles:
            cancelled.set()

    async def probe_health(self) -> None:
        self._check_worker()

    def _check_worker(self) -> Worker:
        """The worker thread, once started and while alive."""
        if not self._ready or self._worker is None:
            raise EngineError(f"stage {self.stage_name}: engine not started")
        if not self._worker.alive():
            raise EngineDeadError(self.stage_name, "its worker thread died")
        return self._worker

    def stats(self) -> dict[str, Any]:
        with self._counts_lock:
            return {
                "running": self._running,
                "waiting": self._waiting,
                "requests_total": self._total,
                "emitted": self._emitted,
                **self.calls.stats(),
            }

    async def _run(
        self, request_id: RequestId, job: Callable[[Emit, threading.Event], None]
    ) -> AsyncGenerator[list[Any], None]:
        """Run ``job(emit, cancelled)`` on the worker thread; yield what it emits, in batches.

        ``cancelled`` is the job's handle in ``self.calls``: an abort of ``request_id`` (the ladder's,
        when the caller leaves early) sets it, and the job's stopping criteria poll it between steps.
        A job's failure is raised here as it was raised on the worker thread.
        """
        worker = self._check_worker()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        # The job waits while MAX_UNTAKEN_OUTPUTS of its outputs are not taken yet: a caller that stops
        # reading (omni_serve.graph.flow) stops the job too, instead of letting it fill this queue.
        room = threading.Semaphore(MAX_UNTAKEN_OUTPUTS)

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody will read this
                cancelled.set()

        def emit(item: Any) -> None:
            while not room.acquire(timeout=0.05):  # polls the abort flag meanwhile
                if cancelled.is_set():
                    return  # aborted: nobody takes it
            with self._counts_lock:
                self._emitted += 1
            put(item)

        def run() -> None:
            with self._counts_lock:
                self._waiting -= 1
                self._running += 1
            last: Any = END
            try:
                if not cancelled.is_set():
                    job(emit, cancelled)
            except BaseException as exc:
                last = Failure(exc)
            finally:
                with self._counts_lock:  # before the end marker: the caller may read stats right after
                    self._running -= 1
            put(last)  # never waits: the end is always taken

        with self._counts_lock:
            self._waiting += 1
            self._total += 1
        with self.calls.track(request_id, cancelled) as call:
            worker.submit(run)
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                if batch[-1] is END or isinstance(batch[-1], Failure):
                    call.finish()  # the job is over: nothing left to abort
                items = batch[:-1] if batch[-1] is END else batch
                for item in items:
                    if isinstance(item, Failure):
                        raise item.exc
                if items:
                    yield items
                    for _ in items:  # taken: the job may emit as many more
                        room.release()
                if call.finished:
                    return


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()
