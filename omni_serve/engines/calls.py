"""The abort registry: stage-call request id -> the engine requests of its live calls.

Every engine family that runs work detached from the caller (an EngineCore request, a job on a
worker thread) tracks it here, so :meth:`StageEngine.abort` can stop all of a call's work by the
id the orchestrator gave the call. A *handle* is whatever the family's abort needs: an engine
request id (vLLM, vLLM-Omni) or a ``threading.Event`` its job polls (transformers, diffusers).

Ordering the registry relies on: a cancellation that reaches a family's stream while it awaits
the engine unwinds the stream (and leaves :meth:`LiveCalls.track`) *before* the ladder
(:mod:`omni_serve.engines.ladder`) gets to abort. So leaving ``track`` without ``finish()`` keeps
the handle registered as an orphan until the next :meth:`LiveCalls.take` for its request id (the
ladder's), instead of forgetting work that is still running in the engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from omni_serve.types import RequestId

H = TypeVar("H")


class Call(Generic[H]):
    """One tracked engine request; ``finish()`` once the engine said it is done (nothing left to abort)."""

    __slots__ = ("handle", "finished", "aborted", "open")

    def __init__(self, handle: H):
        self.handle = handle
        self.finished = False
        self.aborted = False  # handed out by take(): counted once, never twice
        self.open = True  # the stream that made it still runs

    def finish(self) -> None:
        self.finished = True


class LiveCalls(Generic[H]):
    """Live engine requests by stage-call request id; one per engine (per-request state stays in the calls)."""

    def __init__(self) -> None:
        self._calls: dict[RequestId, list[Call[H]]] = {}
        self._serial = itertools.count()
        self.aborted = 0  # engine requests handed out for abort since start

    def mint(self, request_id: RequestId) -> str:
        """A fresh engine request id for one call: engines treat a second live request with a known id as an
        update of the first (vLLM-Omni) or refuse it, and two calls may share a request id (retries, tests)."""
        return f"{request_id}-{next(self._serial)}"

    @contextmanager
    def track(self, request_id: RequestId, handle: H) -> Iterator[Call[H]]:
        """Register ``handle`` under ``request_id`` for the block; see the module doc for what leaving it means."""
        call = Call(handle)
        self._calls.setdefault(request_id, []).append(call)
        try:
            yield call
        finally:
            call.open = False
            if call.finished or call.aborted:
                self._forget(request_id, call)

    def take(self, request_id: RequestId) -> list[H]:
        """The handles of ``request_id`` not finished nor taken before, to abort now; orphans are forgotten."""
        taken = []
        for call in list(self._calls.get(request_id, ())):
            if not call.finished and not call.aborted:
                call.aborted = True
                taken.append(call.handle)
            if not call.open:
                self._forget(request_id, call)
        self.aborted += len(taken)
        return taken

    def _forget(self, request_id: RequestId, call: Call[H]) -> None:
        calls = self._calls.get(request_id)
        if calls is not None and call in calls:
            calls.remove(call)
            if not calls:
                del self._calls[request_id]

    def stats(self) -> dict[str, Any]:
        """``stream_calls``: engine requests whose stream still runs; ``aborted``: handed out for abort so far."""
        return {"stream_calls": sum(c.open for calls in self._calls.values() for c in calls), "aborted": self.aborted}

    def requests(self) -> int:
        """Request ids with tracked engine requests (orphans included)."""
        return len(self._calls)
