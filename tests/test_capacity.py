"""benchmarks/capacity.py's queueing arithmetic against the textbook closed forms (no cluster)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("capacity", Path(__file__).parent.parent / "benchmarks" / "capacity.py")
assert _spec and _spec.loader
capacity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capacity)


@pytest.mark.parametrize("rho", [0.1, 0.5, 0.9])
def test_erlang_wait_matches_mm1_and_mm2(rho: float) -> None:
    service = 0.4
    # M/M/1: Wq = rho / (1 - rho) * S;  M/M/2 (a = 2 rho): Wq = rho^2 / (1 - rho^2) * S
    assert capacity.erlang_wait(1, rho, service) == pytest.approx(rho / (1 - rho) * service)
    assert capacity.erlang_wait(2, 2 * rho, service) == pytest.approx(rho**2 / (1 - rho**2) * service)
    assert capacity.erlang_wait(3, 3.0, service) == math.inf  # offered load = servers: never keeps up


def test_plan_grows_the_slow_stage_until_the_ttfa_fits() -> None:
    costs = {"thinker": 0.1, "talker": 0.5, "code2wav": 0.05}
    plan = capacity.plan_replicas(costs, rate=4.0, ttfa_1=0.3, ttfa=0.6, slots=1)
    waits = sum(capacity.erlang_wait(plan[s], 4.0 * c, c) for s, c in costs.items())
    assert 0.3 + waits <= 0.6
    assert plan["talker"] > plan["thinker"] >= plan["code2wav"] >= 1 and plan["talker"] >= 3  # 4 x 0.5 = 2 erlangs
    pipelines = capacity.plan_pipelines(costs, rate=4.0, ttfa_1=0.3, ttfa=0.6, slots=1)
    # Whole pipelines meet the same target with more replicas in all: each brings every stage along.
    assert pipelines * len(costs) > sum(plan.values()) and pipelines >= 3
