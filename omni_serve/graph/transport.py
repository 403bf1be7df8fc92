"""Handoff payloads: how one crosses from a stage to the next, how long it lives, what it looks like on the wire.

**Lifetime.** A stage yields a handoff as two consecutive items of its Serve stream: the
:class:`StageOutput` with ``handoff=PAYLOAD_FOLLOWS``, then the :class:`HandoffPayload` itself
(:func:`stream_items`). Ray makes every item of a streaming call an object *owned by the caller*:
the ingress replica whose orchestrator runs the request. :func:`stage_outputs` (the caller side)
resolves the small output, takes the next item's ``ObjectRef`` without resolving it, and attaches
it as ``output.handoff``. From there Ray's ordinary reference counting decides: the payload is
freed when the last downstream call that received it has ended (Ray pins a call's arguments until
it returns), or when its request ended (finished, failed, cancelled, client gone). No timer: never
before the last consumer, never much after. Both sides release explicitly what they are done with,
so that frames an exception's traceback keeps alive (until Python's cycle collector runs, which can
take minutes) keep no payload: :func:`stage_outputs` drops the ingress's references when a call
ends, and a stage keeps its input as a :func:`detached` copy and drops the reference.

Why not ``ray.put`` in the stage and a reference nested in the yielded output: Ray 2.60 frees an
object that a replica put and nested in a streamed item while the caller still holds the reference
(ray-project/ray#58080; fix proposed in PR #58082): the downstream replica then fails with
``ReferenceCountingAssertionError``. ``tests/test_handoff_lifetime.py`` reproduces it with plain
Serve deployments. ``ray.put(..., _owner=...)`` could have moved ownership, but Ray 2.56 removed it.
Ownership by the caller also means a stage replica that dies takes no other request's handoff
with it: the bytes sit in its node's object store, owned by the ingress.

**Wire format.** Tensors travel as numpy arrays (zero-copy out of the object store on one node).
numpy has no bfloat16 or float8, so those travel as integer words of the same width with their
dtype named in ``meta["dtypes"]``: bf16 stays 2 bytes a value end to end, where widening to
float32 would double every handoff. :func:`arrays` packs, :func:`tensor` unpacks.

**Evidence the ingress never loads a payload.** Every unpickle of a :class:`HandoffPayload` goes
through :func:`load_payload`, which bumps a counter local to the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from omni_serve.payload import HandoffPayload
from omni_serve.types import StageOutput, StageRequest

if TYPE_CHECKING:
    from ray import ObjectRef, ObjectRefGenerator
    from ray.serve.handle import DeploymentResponseGenerator

# --- lifetime: the payload is its own stream item, owned by the caller -------------------------


class _Marker(enum.Enum):
    PAYLOAD_FOLLOWS = "the next stream item is this output's handoff payload"


PAYLOAD_FOLLOWS = _Marker.PAYLOAD_FOLLOWS  # an enum member: stays itself through pickling


def stream_items(output: StageOutput, wanted: bool) -> list[Any]:
    """What a stage yields for one engine output: the output, then its payload when one is wanted.

    A payload no downstream stage will read (``wanted`` is the request's ``wants_handoff``) is
    dropped here, whatever the engine family, so it is never serialized or stored.
    """
    payload = output.handoff
    if not isinstance(payload, HandoffPayload) or not wanted:
        output.handoff = None
        return [output]
    output.handoff = PAYLOAD_FOLLOWS
    return [output, payload]


async def stage_outputs(response: DeploymentResponseGenerator, request: StageRequest) -> AsyncIterator[StageOutput]:
    """The outputs of the streaming stage call ``response`` made with ``request``, handoffs as refs owned here.

    ``response`` is a by-reference streaming handle call. Each output's ``handoff`` is an
    ``ObjectRef`` this process owns, never resolved here. It is valid until the caller asks for the
    next output or closes the stream: hand it on (into a downstream request) before that. When the
    call is over, ``request.handoff`` is released too, unless the orchestrator may retry the call
    with the same request: its replica died before the call yielded anything. Errors surface as they
    do when iterating ``response`` itself; leaving early (``aclose``) cancels the call.

    Why the releasing: a request that fails or is cancelled leaves exception tracebacks that keep
    this frame and the orchestrator's alive until Python's cycle collector runs, which in a large
    heap can take minutes. Those frames must not keep payloads alive in the meantime.
    """
    from ray.exceptions import TaskCancelledError

    from omni_serve.graph.orchestrator import replica_gone

    output: StageOutput | None = None
    done = False
    retry_may_follow = False
    try:
        items = await response._to_object_ref_gen()
        async for ref in items:
            try:
                output = await ref
            except TaskCancelledError:  # what Serve's own iteration turns a cancelled call into
                raise asyncio.CancelledError() from None
            if output.handoff is PAYLOAD_FOLLOWS:
                output.handoff = await _next_unresolved(items)
            yield output
        done = True
    except Exception as err:
        retry_may_follow = output is None and replica_gone(err)  # the orchestrator's retry rule
        raise
    finally:
        if not done:
            # A call that never started re-raises its start error from cancel(); it was raised above already.
            with contextlib.suppress(Exception):
                response.cancel()
        if output is not None:
            output.handoff = None
        if not retry_may_follow:
            request.handoff = None
        items = response = None  # unconsumed stream items are released with the stream


async def _next_unresolved(items: ObjectRefGenerator) -> ObjectRef:
    """The stream's next ref once its object exists, never fetched or deserialized here.

    ``ObjectRefGenerator.__anext__`` would load the value when the item is not reported yet
    ("TODO: Avoid fetching the value" in Ray 2.60), i.e. load the payload in the ingress. Peeking,
    waiting with ``ObjectRef._on_ready`` and consuming is how Serve 2.60 itself waits for a stream
    item without loading it (``replica_result._consume_generator_ref_when_ready``).
    """
    (ref,) = items._get_next_ref_n(1)
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if ready.done():
            return
        if exc is None:
            ready.set_result(None)
        else:
            ready.set_exception(exc if isinstance(exc, BaseException) else RuntimeError(str(exc)))

    def on_ready(exc: BaseException | None) -> None:  # runs on a Ray thread
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, exc)

    stop_waiting = ref._on_ready(on_ready)
    try:
        await ready
    except BaseException:
        ref = None  # the exception's traceback keeps this frame: it must not keep the payload
        raise
    finally:
        stop_waiting()
    items._consume_next_ref_n(1)
    return ref
