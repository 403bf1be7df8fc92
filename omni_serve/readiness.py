"""What the ingress learns from Serve's controller: which stages have a running replica, and the HTTP timeout.

Readiness never goes through the stages' request queues. A stage is ``ready`` when Serve
runs at least one replica of it: a replica turns RUNNING once its constructor has loaded the
engine, and Serve's periodic health check (which calls the engine's ``check_health``)
replaces it when it fails. Asking the controller answers at once whether the replicas are
idle, saturated or still loading; a probe sent to the replicas would wait behind their
requests (``max_ongoing_requests``) and report a busy, healthy graph as down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

logger = logging.getLogger("ray.serve")

StageState = Literal["ready", "loading", "down"]

# The controller is asked in the background this often, so a probe never waits on it (while Serve
# deploys, the controller can take seconds to answer); the first probe waits at most FIRST_ANSWER_S.
# The refreshing stops once no probe came for IDLE_STOP_S (an idle graph asks the controller for
# nothing) and the next probe starts it again, waiting like a first one for a fresh answer.
REFRESH_S = 1.0
FIRST_ANSWER_S = 0.5
IDLE_STOP_S = 30.0

# Replica states (ray.serve._private.common.ReplicaState) in which a replica is on its way to RUNNING.
_STARTING = {"STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION"}


def _controller() -> Any:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


class ServeView:
    """The ingress' read-only view of its application in Serve's controller.

    Stage states are refreshed in the background once the first probe came; a probe answers
    from the latest refresh at once. Until the controller first answers, every stage counts as
    loading (the ingress itself has just started).
    """

    def __init__(self, app_name: str, stages: list[str]):
        self.app_name = app_name
        self.stages = stages
        self._controller = _controller()
        self._states: dict[str, StageState] = dict.fromkeys(stages, "loading")
        self._fresh: asyncio.Event | None = None  # set once the running refresher has answered; None: not running
        self._last_probe = 0.0

    def request_timeout_s(self) -> float | None:
        """Serve's ``http_options.request_timeout_s`` (None: no limit). Blocking: call it at start."""
        import ray

        timeout = ray.get(self._controller.get_http_config.remote()).request_timeout_s
        return float(timeout) if timeout and timeout > 0 else None

    async def stage_states(self) -> dict[str, StageState]:
        """The stages' states as of the latest refresh (at most ``REFRESH_S`` plus one controller answer old)."""
        self._last_probe = time.monotonic()
        if self._fresh is None:
            self._fresh = asyncio.Event()
            asyncio.get_running_loop().create_task(self._refresh_while_probed(self._fresh))
        try:
            await asyncio.wait_for(self._fresh.wait(), FIRST_ANSWER_S)
        except asyncio.TimeoutError:
            pass
        return dict(self._states)

    async def _refresh_while_probed(self, fresh: asyncio.Event) -> None:
        try:
            while time.monotonic() - self._last_probe < IDLE_STOP_S:
                try:
                    details = await self._controller.get_serve_instance_details.remote()
                    deployments = details.get("applications", {}).get(self.app_name, {}).get("deployments", {})
                    self._states = {
                        name: replica_state([r.get("state") for r in deployments.get(name, {}).get("replicas", [])])
                        for name in self.stages
                    }
                    fresh.set()
                except Exception as err:  # keep the last answer; the controller may be restarting
                    logger.warning("readiness: Serve's controller did not answer: %s", type(err).__name__)
                await asyncio.sleep(REFRESH_S)
        finally:
            self._fresh = None


def replica_state(replicas: list[str | None]) -> StageState:
    """A stage's state from its replicas' Serve states."""
    if "RUNNING" in replicas:
        return "ready"
    if any(state in _STARTING for state in replicas):
        return "loading"
    return "down"
