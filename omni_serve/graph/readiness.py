"""What the ingress learns from Serve's controller: stage readiness, replica counts, the HTTP options.

Readiness never goes through the stages' request queues. A stage is ``ready`` when Serve
runs at least one replica of it: a replica turns RUNNING once its constructor has loaded the
engine, and Serve's periodic health check (which calls the engine's ``check_health``)
replaces it when it fails. Asking the controller answers at once whether the replicas are
idle, saturated or still loading; a probe sent to the replicas would wait behind their
requests (``max_ongoing_requests``) and report a busy, healthy graph as down.

One background task per ingress asks the controller; ``/health``, ``/stages`` and the ready
line all read its latest answer, so no route ever waits on the controller (which can take
seconds to answer while Serve deploys).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

logger = logging.getLogger("ray.serve")

StageState = Literal["ready", "loading", "down"]

# The controller is asked this often while anyone reads the view; the first read waits at most FIRST_ANSWER_S.
REFRESH_S = 1.0
FIRST_ANSWER_S = 0.5
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
        self._first = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_read = 0.0

    def request_timeout_s(self) -> float | None:
        """Serve's ``http_options.request_timeout_s`` (None: no limit). Blocking: call it at start."""
        import ray

        timeout = ray.get(self._controller.get_http_config.remote()).request_timeout_s
        return float(timeout) if timeout and timeout > 0 else None

    async def details(self) -> dict[str, Any]:
        """The latest controller answer (at most ``REFRESH_S`` plus one controller answer old; {} before the first)."""
        loop = asyncio.get_running_loop()
        self._last_read = loop.time()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._refresh_while_read())
        try:
            await asyncio.wait_for(self._first.wait(), FIRST_ANSWER_S)
        except asyncio.TimeoutError:
            pass
        return self._details

    async def application(self) -> dict[str, Any]:
        """This application's entry of the latest answer: status, route_prefix, deployments with replicas."""
        return (await self.details()).get("applications", {}).get(self.app_name, {})

    async def stage_states(self) -> dict[str, StageState]:
        deployments = (await self.application()).get("deployments", {})
        return {
            name: replica_state([r.get("state") for r in deployments.get(deployment, {}).get("replicas", [])])
            for name, deployment in self.stages.items()
        }

    async def _refresh_while_read(self) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() - self._last_read < IDLE_STOP_S:
            try:
                self._details = await self._controller.get_serve_instance_details.remote()
                self._first.set()
            except Exception as err:  # keep the last answer; the controller may be restarting
                logger.warning("readiness: Serve's controller did not answer: %s", type(err).__name__)
            await asyncio.sleep(REFRESH_S)


def replica_state(replicas: list[str | None]) -> StageState:
    """A stage's state from its replicas' Serve states."""
    if "RUNNING" in replicas:
        return "ready"
    if any(state in _STARTING for state in replicas):
        return "loading"
    return "down"
