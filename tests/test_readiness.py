"""Readiness (omni_serve.graph.readiness) in process, over a stand-in for Serve's controller that answers,
hangs or fails on command: /health never repeats an answer the controller stopped giving."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest

from omni_serve.graph import readiness
from omni_serve.graph.readiness import ServeView

STAGES = {"thinker": "thinker", "talker": "talker"}
RUNNING = {
    "applications": {
        "omni": {"status": "RUNNING", "deployments": {s: {"replicas": [{"state": "RUNNING"}]} for s in STAGES}}
    }
}


class Controller:
    """``get_serve_instance_details.remote()`` as Serve's controller handle has it; ``mode`` says how it answers."""

    def __init__(self) -> None:
        self.mode = "answer"
        self.calls = 0
        self.get_serve_instance_details = self  # the method's handle: .remote()

    def remote(self) -> Awaitable[dict[str, Any]]:
        self.calls += 1
        if self.mode == "hang":  # a controller that died mid-call: the call never returns
            return asyncio.get_running_loop().create_future()

        async def answer() -> dict[str, Any]:
            if self.mode == "fail":
                raise RuntimeError("the controller actor died")
            return RUNNING

        return answer()


@pytest.fixture
def controller(monkeypatch: pytest.MonkeyPatch) -> Controller:
    fake = Controller()
    monkeypatch.setattr(readiness, "_controller", lambda: fake)
    monkeypatch.setattr(readiness, "REFRESH_S", 0.02)
    monkeypatch.setattr(readiness, "STALE_S", 0.5)
    return fake


async def until(predicate: Any, what: str, timeout_s: float = 30) -> None:
    """Poll (reading the view keeps its refresh going) until ``predicate()``; the timeout is a hang guard."""

    async def poll() -> None:
        while not await predicate():  # noqa: ASYNC110  - polling is the point: reads keep the refresh going
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except asyncio.TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


@pytest.mark.parametrize("mode", ["hang", "fail"])
def test_states_turn_unknown_when_the_controller_stops_answering_and_come_back_with_it(controller, mode) -> None:
    async def go() -> None:
        view = ServeView("omni", STAGES)
        assert await view.stage_states() == {"thinker": "ready", "talker": "ready"}
        controller.mode = mode
        await until(
            lambda: _states_are(view, "unknown"), f"the stages to turn unknown with the controller's calls {mode}ing"
        )
        calls = controller.calls
        controller.mode = "answer"
        await until(lambda: _states_are(view, "ready"), "the stages to be ready again once the controller answers")
        assert controller.calls > calls  # a hung call was given up and the controller asked again

    asyncio.run(go())


def test_health_is_503_saying_the_controller_is_silent(controller) -> None:
    async def go() -> tuple[tuple[int, dict[str, Any]], tuple[int, dict[str, Any]]]:
        view = ServeView("omni", STAGES)
        healthy = await view.health()
        controller.mode = "hang"
        await until(lambda: _states_are(view, "unknown"), "the stages to turn unknown")
        return healthy, await view.health()

    (ok_status, ok_body), (status, body) = asyncio.run(go())
    assert ok_status == 200 and ok_body == {"status": "ok", "stages": {"thinker": "ready", "talker": "ready"}}
    assert status == 503 and body["status"] == "unavailable"
    assert body["stages"] == {"thinker": "unknown", "talker": "unknown"}
    assert "Serve's controller has not answered for" in body["message"] and "more than 0.5 s" in body["message"]


def test_an_answer_that_aged_while_nobody_read_is_not_the_controllers_silence(controller, monkeypatch) -> None:
    """The refresh stops without readers; the next read restarts it and gets a current answer, not a 503."""
    monkeypatch.setattr(readiness, "IDLE_STOP_S", 0.1)

    async def go() -> int:
        view = ServeView("omni", STAGES)
        assert (await view.health())[0] == 200
        await asyncio.sleep(1.0)  # past IDLE_STOP_S (the refresh stops) and STALE_S (the answer ages)
        return (await view.health())[0]

    assert asyncio.run(go()) == 200


def test_loading_and_down_stages_are_named(controller, monkeypatch) -> None:
    details = {
        "applications": {
            "omni": {
                "deployments": {
                    "thinker": {"replicas": [{"state": "STARTING"}]},
                    "talker": {"replicas": []},
                }
            }
        }
    }

    async def answer() -> dict[str, Any]:
        return details

    monkeypatch.setattr(controller, "remote", answer)

    async def go() -> tuple[int, dict[str, Any]]:
        return await ServeView("omni", STAGES).health()

    status, body = asyncio.run(go())
    assert status == 503 and body["stages"] == {"thinker": "loading", "talker": "down"}
    assert body["message"] == "down: talker; loading: thinker"


async def _states_are(view: ServeView, state: str) -> bool:
    return set((await view.stage_states()).values()) == {state}
