"""What the ingress learns from Serve's controller: stage readiness, replica counts, the HTTP options.

Readiness never goes through the stages' request queues. A stage is ``ready`` when Serve
runs at least one replica of it: a replica turns RUNNING once its constructor has loaded the
engine, and Serve's periodic health check (which calls the engine's ``check_health``)
replaces it when it fails. Asking the controller answers at once whether the replicas are
idle, saturated or still loading; a probe sent to the replicas would wait behind their
requests (``max_ongoing_requests``) and report a busy, healthy graph as down.

One background task per ingress asks the controller; ``/health``, ``/stages`` and the ready
line all read its latest answer, so no route ever waits on the controller (which can take
seconds to answer while Serve deploys). An answer older than ``STALE_S`` is not trusted: when
the controller stops answering (dead, restarting, its calls hanging or failing), ``/health``
turns 503 ``STALE_S`` after its last answer and says so, instead of repeating that answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

logger = logging.getLogger("ray.serve")

StageState = Literal["ready", "loading", "down", "unknown"]

# The controller is asked this often while anyone reads the view; a read that finds no fresh answer (the
# first, or the first after an idle stop) waits at most FIRST_ANSWER_S for one.
REFRESH_S = 1.0
FIRST_ANSWER_S = 0.5
# An answer older than this is stale: every stage's state is then "unknown" and /health answers 503. A call
# to the controller that has not answered by then is given up and asked again.
STALE_S = 10.0
# ... and only while someone reads it: an idle ingress stops asking (a later read restarts it).
IDLE_STOP_S = 30.0

# Replica states (ray.serve._private.common.ReplicaState) in which a replica is on its way to RUNNING.
_STARTING = {"STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION"}


def _controller() -> Any:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


class ServeView:
    """The ingress' read-only view of its application in Serve's controller.

    Refreshed in the background while it is read (a read restarts a stopped refresh). Until the
    controller first answers, every stage counts as loading (the ingress itself has just started).
    """

    def __init__(self, app_name: str, stages: dict[str, str]):
        self.app_name = app_name
        self.stages = stages  # stage name -> the deployment that runs it
        self._controller = _controller()
        self._details: dict[str, Any] = {}  # the controller's latest get_serve_instance_details()
        self._answered_at: float | None = None  # loop time of that answer; None: none yet
        self._asking_since = 0.0  # loop time the refresh last (re)started
        self._answer = asyncio.Event()  # set by each answer
        self._task: asyncio.Task[None] | None = None
        self._last_read = 0.0

    def http_options(self) -> Any:
        """Serve's ``HTTPOptions`` (host, port, request_timeout_s, ...). Blocking: call it at start."""
        import ray

        return ray.get(self._controller.get_http_config.remote())

    def silent_s(self) -> float | None:
        """How long the controller has been silent when its last answer is stale; None while it is fresh or
        none came yet (an ingress that has just started counts its stages as loading)."""
        if self._answered_at is None:
            return None
        # Counted from the later of the last answer and the refresh's restart: an answer that aged while
        # nobody read the view (the refresh stopped) is not the controller's silence.
        silent = asyncio.get_running_loop().time() - max(self._answered_at, self._asking_since)
        return silent if silent > STALE_S else None

    async def details(self) -> dict[str, Any]:
        """The latest controller answer (at most ``REFRESH_S`` plus one controller answer old while the
        controller answers; {} before the first)."""
        loop = asyncio.get_running_loop()
        self._last_read = loop.time()
        restarted = self._task is None or self._task.done()
        if restarted:  # the first read, or the first since the refresh stopped for want of readers
            self._answer.clear()
            self._asking_since = loop.time()
            self._task = loop.create_task(self._refresh_while_read())
        if restarted or self._answered_at is None:  # wait a moment for a current answer
            try:
                await asyncio.wait_for(self._answer.wait(), FIRST_ANSWER_S)
            except asyncio.TimeoutError:  # not the builtin before Python 3.11
                pass
        return self._details

    async def application(self) -> dict[str, Any]:
        """This application's entry of the latest answer: status, route_prefix, deployments with replicas."""
        return (await self.details()).get("applications", {}).get(self.app_name, {})

    async def stage_states(self) -> dict[str, StageState]:
        deployments = (await self.application()).get("deployments", {})
        if self.silent_s() is not None:
            return {name: "unknown" for name in self.stages}
        return {
            name: replica_state([r.get("state") for r in deployments.get(deployment, {}).get("replicas", [])])
            for name, deployment in self.stages.items()
        }

    async def _refresh_while_read(self) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() - self._last_read < IDLE_STOP_S:
            try:
                # Bounded: a call that hangs (a controller that died mid-call) must not stop the refresh.
                self._details = await asyncio.wait_for(self._controller.get_serve_instance_details.remote(), STALE_S)
                self._answered_at = loop.time()
                self._answer.set()
            except Exception as err:  # keep the last answer until it goes stale; the controller may be restarting
                logger.warning("readiness: Serve's controller did not answer: %s", type(err).__name__)
            await asyncio.sleep(REFRESH_S)

    async def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status and body: 200 when every stage has a running replica; 503 naming the stages
        loading or down, or saying that the controller stopped answering (every stage then ``unknown``)."""
        states = await self.stage_states()
        ok = all(state == "ready" for state in states.values())
        body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "stages": states}
        silent = self.silent_s()
        if silent is not None:
            body["message"] = (
                f"Serve's controller has not answered for {silent:.0f} s (more than {STALE_S:g} s): "
                "the stages' states are unknown"
            )
        elif not ok:
            waiting = {state: [n for n, s in states.items() if s == state] for state in set(states.values())}
            body["message"] = "; ".join(
                f"{state}: {', '.join(n)}" for state, n in sorted(waiting.items()) if state != "ready"
            )
        return (200 if ok else 503), body


def replica_state(replicas: list[str | None]) -> StageState:
    """A stage's state from its replicas' Serve states."""
    if "RUNNING" in replicas:
        return "ready"
    if any(state in _STARTING for state in replicas):
        return "loading"
    return "down"
