"""The application-level autoscaling policy on synthetic Serve contexts (fast; no cluster)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy
from ray.serve.schema import ServeDeploySchema

from omni_serve.graph.autoscaling import (
    ALL_STAGES,
    PolicyConfig,
    StageLoad,
    StagePolicy,
    apply_min_ratios,
    decide,
    wanted_replicas,
)
from omni_serve.graph.config import load_graph

GRAPHS = Path(__file__).resolve().parent.parent / "graphs"
APP = "omni"
RATIOS = {"code2wav": {"talker": 0.5}}


def ctx(
    name: str,
    ongoing: float,
    *,
    replicas: int = 1,
    target_replicas: int | None = None,
    target_ongoing: float = 4,
    max_replicas: int = 4,
    min_replicas: int = 1,
    engine_waiting: list[float] | None = None,
    policy_state: dict[str, Any] | None = None,
    **config: Any,
) -> AutoscalingContext:
    dep = DeploymentID(name=name, app_name=APP)
    custom = {"engine_waiting": {f"{name}#{i}": w for i, w in enumerate(engine_waiting)}} if engine_waiting else {}
    return AutoscalingContext(
        deployment_id=dep,
        deployment_name=name,
        app_name=APP,
        current_num_replicas=replicas,
        target_num_replicas=replicas if target_replicas is None else target_replicas,
        running_replicas=[],
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics=lambda: custom,
        raw_metrics={},
        capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state=policy_state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=AutoscalingConfig(
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            target_ongoing_requests=target_ongoing,
            **{"upscale_delay_s": 0, "downscale_delay_s": 0, **config},
        ),
    )


def decisions(policy: StagePolicy, *contexts: AutoscalingContext) -> dict[str, float]:
    wanted, state = policy({c.deployment_id: c for c in contexts})
    assert set(state) == set(wanted) == {c.deployment_id for c in contexts}
    return {dep.name: value for dep, value in wanted.items()}


def load(name: str, ongoing: float, target_ongoing: float = 4, replicas: int = 1, **kw: Any) -> StageLoad:
    kw.setdefault("target_replicas", replicas)
    kw.setdefault("min_replicas", 1)
    kw.setdefault("max_replicas", 4)
    return StageLoad(name, running_replicas=replicas, ongoing=ongoing, target_ongoing=target_ongoing, **kw)


# ---- each stage on its own load ------------------------------------------------------------------


def test_each_stage_wants_its_ongoing_over_its_own_target():
    policy = StagePolicy()
    got = decisions(
        policy,
        ctx("thinker", 3, target_ongoing=8),
        ctx("talker", 12, replicas=2, target_ongoing=4),
        ctx("code2wav", 0, target_ongoing=16),
    )
    assert got == {"thinker": 1.0, "talker": 3.0, "code2wav": 1.0}  # bounded below by min_replicas 1


def test_a_text_only_load_raises_only_the_thinker():
    got = decide(
        {"thinker": load("thinker", 9, 2), "talker": load("talker", 0), "code2wav": load("code2wav", 0)},
        PolicyConfig.parse(RATIOS),
    )
    assert got == {"thinker": 4.0, "talker": 1.0, "code2wav": 1.0}  # thinker capped at max_replicas 4


def test_engine_waiting_above_threshold_asks_one_more_replica_than_running():
    stage = load("thinker", ongoing=2, target_ongoing=32, replicas=2)
    assert wanted_replicas(stage) == 2 / 32
    waiting = load("thinker", ongoing=2, target_ongoing=32, replicas=2, engine_waiting=5.0)
    assert wanted_replicas(waiting, max_engine_waiting=4) == 3
    assert wanted_replicas(waiting, max_engine_waiting=5) == 2 / 32  # not above: load rules
    assert wanted_replicas(waiting) == 2 / 32  # no threshold configured: ignored


def test_engine_waiting_comes_from_the_stage_metric_averaged_over_replicas():
    policy = StagePolicy(max_engine_waiting={"talker": 1})
    got = decisions(policy, ctx("talker", 2, replicas=2, engine_waiting=[3, 1]), ctx("thinker", 2, engine_waiting=[9]))
    assert got == {"talker": 3, "thinker": 1}  # mean 2 > 1 -> running + 1; thinker has no threshold
    everyone = StagePolicy(max_engine_waiting=0)
    assert decisions(everyone, ctx("thinker", 0, engine_waiting=[1]))["thinker"] == 2


# ---- ratios ----------------------------------------------------------------------------------------


def test_ratio_raises_code2wav_with_the_talker():
    policy = StagePolicy(min_ratios=RATIOS)
    got = decisions(policy, ctx("talker", 12, replicas=1, target_ongoing=4), ctx("code2wav", 1, target_ongoing=16))
    assert got == {"talker": 3.0, "code2wav": 2.0}  # ceil(0.5 * 3)


def test_ratio_holds_while_the_partner_still_has_replicas_it_wants_to_drop():
    # Talker idle but its target is still 4 (downscale delay running): code2wav keeps 2.
    policy = StagePolicy(min_ratios=RATIOS)
    got = decisions(policy, ctx("talker", 0, replicas=4), ctx("code2wav", 0, replicas=2))
    assert got == {"talker": 1.0, "code2wav": 2.0}


def test_ratio_floor_is_capped_by_max_replicas_and_ignores_unknown_stages(caplog):
    stages = {"talker": load("talker", 40, max_replicas=8), "code2wav": load("code2wav", 0, max_replicas=2)}
    assert apply_min_ratios(stages, {"talker": 10.0, "code2wav": 0.0}, {"code2wav": {"talker": 1.0}}) == {
        "talker": 10.0,
        "code2wav": 2.0,
    }
    policy = StagePolicy(min_ratios={"vocoder": {"talker": 1}})
    logger = logging.getLogger("ray.serve")  # Serve's logger does not propagate to the root
    logger.addHandler(caplog.handler)
    try:
        assert decisions(policy, ctx("talker", 4))["talker"] == 1.0
        decisions(policy, ctx("talker", 4))
    finally:
        logger.removeHandler(caplog.handler)
    assert sum("'vocoder'" in r.getMessage() for r in caplog.records) == 1  # warned once


def test_ratio_chains_propagate():
    stages = {n: load(n, 0, max_replicas=8) for n in ("a", "b", "c")}
    got = apply_min_ratios(stages, {"a": 6.0, "b": 0.0, "c": 0.0}, {"c": {"b": 1.0}, "b": {"a": 0.5}})
    assert got == {"a": 6.0, "b": 3.0, "c": 3.0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_ratios": {"code2wav": {"talker": 0}}}, r"min_ratios.code2wav.talker: expected a number > 0"),
        ({"min_ratios": {"code2wav": 0.5}}, r"min_ratios.code2wav: expected \{other_stage: ratio\}"),
        ({"min_ratios": {"talker": {"talker": 1}}}, "its own ratio partner"),
        ({"max_engine_waiting": {"talker": -1}}, r"max_engine_waiting.talker: expected a number >= 0"),
    ],
)
def test_bad_policy_kwargs_fail_with_the_key_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StagePolicy(**kwargs)


# ---- through Serve's own wrapper: delays and bounds still apply per stage ---------------------------


def test_serve_wrapper_applies_delays_to_the_bounded_policy_output():
    wrapped = _apply_app_level_autoscaling_config(StagePolicy(min_ratios=RATIOS))
    contexts = [
        ctx("thinker", 0, target_ongoing=4, max_replicas=3),  # idle -> min_replicas
        ctx("talker", 40, target_ongoing=2, max_replicas=3),  # wants 20 -> max_replicas
        ctx("code2wav", 0, target_ongoing=8, max_replicas=3),  # ratio: ceil(0.5 * 3) = 2
    ]
    decisions_, _ = wrapped({c.deployment_id: c for c in contexts})
    assert {d.name: n for d, n in decisions_.items()} == {"thinker": 1, "talker": 3, "code2wav": 2}

    delayed = _apply_app_level_autoscaling_config(StagePolicy(min_ratios=RATIOS))
    talker = ctx("talker", 40, target_ongoing=2, max_replicas=3, upscale_delay_s=60)
    decisions_, _ = delayed({talker.deployment_id: talker})
    assert decisions_[talker.deployment_id] == 1  # wants 3, waits out upscale_delay_s


# ---- the shipped graph files -------------------------------------------------------------------------


def _graph_files() -> list[Path]:
    return sorted(GRAPHS.glob("*.yaml"))


@pytest.mark.parametrize("path", _graph_files(), ids=lambda p: p.name)
def test_every_shipped_graph_autoscales_every_stage_with_the_policy(path):
    config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(config)  # a valid Serve config, autoscaling_policy included
    for app in config["applications"]:
        policy = AutoscalingPolicy(**app["autoscaling_policy"])
        assert policy.policy_function == "omni_serve.graph.autoscaling:StagePolicy"
        instance = policy.get_policy()(**policy.policy_kwargs)  # what the controller does
        # The policy sees deployments: a stage's own, or the ingress where the engine runs in it.
        graph = load_graph(app["args"])
        stages = {graph.deployment(s.name) for s in graph.stages}
        deployments = {d["name"]: d for d in app["deployments"]}
        named = set(instance.config.min_ratios) | {o for p in instance.config.min_ratios.values() for o in p}
        named |= set(instance.config.max_engine_waiting) - {ALL_STAGES}
        assert named <= stages, f"{path.name}: the policy names unknown stage deployments {named - stages}"
        for stage in stages:
            assert stage in deployments, f"{path.name}: stage {stage} has no deployments: entry"
            entry = deployments[stage]
            auto = AutoscalingConfig(**entry["autoscaling_config"])
            assert "target_ongoing_requests" in entry["autoscaling_config"], (path.name, stage)
            assert "max_ongoing_requests" in entry, (path.name, stage)
            assert auto.target_ongoing_requests <= entry["max_ongoing_requests"], (path.name, stage)
            assert 1 <= auto.min_replicas <= auto.max_replicas, (path.name, stage)


def test_a_change_of_wish_is_logged_once_with_its_reason(caplog):
    logger = logging.getLogger("ray.serve")
    logger.addHandler(caplog.handler)
    try:
        policy = StagePolicy(min_ratios=RATIOS)
        for _ in range(3):  # Serve calls the policy every 0.1 s; one line per change
            decisions(policy, ctx("talker", 12, target_ongoing=4), ctx("code2wav", 1, target_ongoing=16))
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "omni_serve autoscaling" in r.getMessage()]
    assert len(lines) == 2
    assert "talker wants 3 replica(s) (running 1; ongoing 12.0 / target 4.0)" in lines[0]
    assert "code2wav wants 2" in lines[1] and "raised by min_ratios" in lines[1]


def test_a_stopping_stage_reports_no_engine_queue_instead_of_failing():
    """Serve asks for the custom metrics until a replica is gone, also after ``shutdown`` let its engine go (a
    replica being deleted logged "Replica autoscaling stats failed ... no attribute 'engine'" until this)."""
    from omni_serve.graph.stage import Stage

    stage = Stage({"name": "talker", "engine": "transformers", "engine_args": {"model_stage": "talker"}})
    assert stage.record_autoscaling_stats() == {"engine_waiting": 0.0, "engine_running": 0.0}
    stage.shutdown()
    assert stage.record_autoscaling_stats() == {}
