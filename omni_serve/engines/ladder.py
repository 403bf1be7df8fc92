"""The exception ladder every engine family runs under, written once (as ``AsyncLLM.generate`` in vLLM).

:meth:`StageEngine.generate <omni_serve.engines.base.StageEngine.generate>` runs a family's
``stream`` through :func:`guarded`, and :meth:`StageEngine.check_health` through
:func:`checked_health`. How a call ends, rung by rung:

(a) cancelled (``CancelledError``, or ``GeneratorExit`` when the consumer closes the stream)
    before the final output: the call's engine requests are aborted
    (:meth:`StageEngine.abort` by the call's request id), then the cancellation goes on;
(b) the engine is dead (``EngineDeadError``, or an error the family's ``dead_reason`` hook
    recognises: vLLM's ``EngineDeadError``, a dead EngineCore or worker thread): the engine is
    marked dead, so every later call and health check raises ``EngineDeadError`` and Serve
    replaces the replica; the caller gets ``EngineDeadError`` (503, ``engine_dead``);
(c) a bad request (``InvalidStageInput``, or an error the family's ``invalid_input`` hook maps
    to one): raised as is (400 naming the field);
(d) anything else: logged here with its traceback; the caller gets an ``EngineError`` that names
    the stage and the call but carries no exception text. An ``EngineError`` the family raised
    itself already says what went wrong in words meant for logs and passes through.

Every rung but (b) aborts what the call left running (a no-op when nothing did); a dead engine
has nothing left to abort. An abort that fails is logged, never raised over the error at hand.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

from omni_serve.exceptions import EngineDeadError, EngineError, InvalidStageInput
from omni_serve.payload import HandoffPayload
from omni_serve.types import RequestId, StageOutput, StageRequest

logger = logging.getLogger("ray.serve")


class LadderEngine(Protocol):
    """What the ladder uses of an engine: :class:`~omni_serve.engines.base.StageEngine` has it all.

    Named here, not imported from ``base`` (which imports this module), so neither module needs the other.
    """

    stage_name: str
    dead: str | None

    def stream(self, request: StageRequest, handoff: HandoffPayload | None) -> AsyncIterator[StageOutput]: ...

    async def abort(self, request_id: RequestId) -> None: ...

    async def probe_health(self) -> None: ...

    def dead_reason(self, err: BaseException) -> str | None: ...

    def invalid_input(self, err: BaseException) -> InvalidStageInput | None: ...

    def mark_dead(self, reason: str) -> None: ...


async def guarded(
    engine: LadderEngine, request: StageRequest, handoff: HandoffPayload | None
) -> AsyncGenerator[StageOutput, None]:
    """``engine.stream(request, handoff)`` under the ladder (module doc)."""
    if engine.dead is not None:  # refused at once until Serve replaces the replica
        raise EngineDeadError(engine.stage_name, engine.dead)
    finished = False
    stream: AsyncIterator[StageOutput] | None = None
    try:
        stream = engine.stream(request, handoff)
        async for output in stream:
            finished = finished or output.finished
            yield output
    except (asyncio.CancelledError, GeneratorExit):
        if not finished:  # closed after its final output: the engine already let go of it
            await _abort(engine, request.request_id)
        raise
    except Exception as err:
        dead = _dead_reason(engine, err)
        if dead is not None:
            engine.mark_dead(dead)
            logger.error("stage %s: engine dead (%s) during call %s", engine.stage_name, dead, request.request_id)
            raise EngineDeadError(engine.stage_name, dead) from None
        await _abort(engine, request.request_id)
        if isinstance(err, InvalidStageInput | EngineError):
            raise
        invalid = engine.invalid_input(err)
        if invalid is not None:
            raise invalid from None
        logger.error("stage %s: call %s failed", engine.stage_name, request.request_id, exc_info=err)
        raise EngineError(
            f"stage {engine.stage_name}: the engine failed on call {request.request_id}; see the replica log"
        ) from None
    finally:
        if stream is not None:
            await stream.aclose()  # type: ignore[attr-defined]  # an async generator


async def checked_health(engine: LadderEngine) -> None:
    """Raise ``EngineDeadError`` once the engine is dead (marking it when the family's probe finds out)."""
    if engine.dead is not None:
        raise EngineDeadError(engine.stage_name, engine.dead)
    try:
        await engine.probe_health()
    except Exception as err:
        dead = _dead_reason(engine, err)
        if dead is None:
            raise
        engine.mark_dead(dead)
        raise EngineDeadError(engine.stage_name, dead) from None


def _dead_reason(engine: LadderEngine, err: BaseException) -> str | None:
    if isinstance(err, EngineDeadError):
        return err.reason
    # Marked dead while the call ran (a family's failure callback): whatever it raised came of that.
    return engine.dead if engine.dead is not None else engine.dead_reason(err)


async def _abort(engine: LadderEngine, request_id: RequestId) -> None:
    # Shielded: a second cancellation while the abort is on its way must not leave the engine request running.
    try:
        await asyncio.shield(engine.abort(request_id))
    except Exception:  # never raised over the error or cancellation at hand
        logger.warning("stage %s: aborting call %s failed", engine.stage_name, request_id, exc_info=True)
