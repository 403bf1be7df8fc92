"""Application-level autoscaling: each stage scales on its own load, stages keep minimum ratios.

A graph file names the policy in its application's ``autoscaling_policy`` (Serve 2.60
instantiates a policy *class* once with ``policy_kwargs``; a plain function would get
no kwargs)::

    autoscaling_policy:
      policy_function: omni_serve.graph.autoscaling:StagePolicy
      policy_kwargs:
        min_ratios: {code2wav: {talker: 0.5}}   # code2wav >= ceil(0.5 x talker replicas)

Every tick Serve hands the policy one ``AutoscalingContext`` per deployment that has an
``autoscaling_config`` (the stages; the ingress has none) and applies, per deployment,
the usual ``upscale_delay_s`` / ``downscale_delay_s``, up/downscaling factors and
``min_replicas`` / ``max_replicas`` bounds to what the policy returns.

Per stage the wanted replica count is

    ongoing / target_ongoing_requests

where ``ongoing`` is Serve's own load signal (requests running in the stage's replicas
plus requests queued at the handles calling it, averaged over ``look_back_period_s``).
An engine batches internally, so ``target_ongoing_requests`` is the number of concurrent
calls one replica serves well (e.g. half of vLLM's ``max_num_seqs``); code2wav is called
once per codec chunk, so its target counts chunks, not client requests.

Optional ``max_engine_waiting`` (per stage, or ``"*"`` for all): when a stage's replicas
report more engine-waiting requests on average than this (the stage deployment's
``record_autoscaling_stats`` sends ``engine_waiting`` for engines that know it, e.g.
vLLM's scheduler queue), the stage wants one replica more than it runs now, whatever
its ongoing count says: the engine is full and queues work it cannot batch.

``min_ratios`` then raises downstream stages: ``{stage: {other: r}}`` keeps
``replicas(stage) >= ceil(r * replicas(other))``, where ``replicas(other)`` is the larger
of the other stage's current target and what it wants now. Raising against the current
target (not only the wish) means a stage never drops below its ratio while its partner
still waits out a downscale delay; the floor is capped by the stage's ``max_replicas``.

The policy object is cloudpickled by value into the Serve controller: this module
imports nothing from omni_serve.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("ray.serve")

ENGINE_WAITING = "engine_waiting"  # custom autoscaling metric the stage deployment reports
ALL_STAGES = "*"
LOG_INTERVAL_S = 2.0
_EPS = 1e-9


@dataclass(frozen=True)
class StageLoad:
    """What the policy needs to know about one stage this tick (built from Serve's context)."""

    name: str
    running_replicas: int  # replicas serving now
    target_replicas: int  # the autoscaler's current target (may differ while replicas start/stop)
    ongoing: float  # running in the replicas + queued at handles
    target_ongoing: float  # per replica, from the stage's autoscaling_config
    min_replicas: int
    max_replicas: int
    engine_waiting: float | None = None  # mean per replica, if the engine reports it


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's ``policy_kwargs``, validated once when Serve instantiates the policy."""

    min_ratios: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    max_engine_waiting: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, min_ratios: Any = None, max_engine_waiting: Any = None) -> PolicyConfig:
        ratios: dict[str, dict[str, float]] = {}
        for stage, partners in (min_ratios or {}).items():
            if not isinstance(partners, Mapping) or not partners:
                raise ValueError(f"min_ratios.{stage}: expected {{other_stage: ratio}}, got {partners!r}")
            for other, ratio in partners.items():
                if other == stage:
                    raise ValueError(f"min_ratios.{stage}.{other}: a stage cannot be its own ratio partner")
                if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
                    raise ValueError(f"min_ratios.{stage}.{other}: expected a number > 0, got {ratio!r}")
            ratios[str(stage)] = {str(o): float(r) for o, r in partners.items()}
        if isinstance(max_engine_waiting, (int, float)) and not isinstance(max_engine_waiting, bool):
            max_engine_waiting = {ALL_STAGES: max_engine_waiting}
        waiting: dict[str, float] = {}
        for stage, threshold in (max_engine_waiting or {}).items():
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
                raise ValueError(f"max_engine_waiting.{stage}: expected a number >= 0, got {threshold!r}")
            waiting[str(stage)] = float(threshold)
        return cls(min_ratios=ratios, max_engine_waiting=waiting)

    def waiting_threshold(self, stage: str) -> float | None:
        return self.max_engine_waiting.get(stage, self.max_engine_waiting.get(ALL_STAGES))


def wanted_replicas(stage: StageLoad, max_engine_waiting: float | None = None) -> float:
    """Replicas this stage wants from its own load alone (a float; Serve rounds up and bounds it)."""
    wanted = stage.ongoing / stage.target_ongoing
    if (
        max_engine_waiting is not None
        and stage.engine_waiting is not None
        and stage.engine_waiting > max_engine_waiting
    ):
        wanted = max(wanted, stage.running_replicas + 1)
    return wanted


def _bounded(stage: StageLoad, replicas: float) -> int:
    return max(stage.min_replicas, min(stage.max_replicas, math.ceil(replicas - _EPS)))


def apply_min_ratios(
    stages: Mapping[str, StageLoad], wanted: Mapping[str, float], min_ratios: Mapping[str, Mapping[str, float]]
) -> dict[str, float]:
    """Raise stages to ``ceil(ratio x partner)``; partners count as max(current target, their wish)."""
    result = dict(wanted)
    # Floors only ever rise, and each is capped by max_replicas, so this reaches a fixpoint;
    # len(stages) + 1 rounds cover any chain of ratios.
    for _ in range(len(stages) + 1):
        changed = False
        for name, partners in min_ratios.items():
            if name not in stages:
                continue
            stage = stages[name]
            for other, ratio in partners.items():
                if other not in stages:
                    continue
                partner = max(stages[other].target_replicas, _bounded(stages[other], result[other]))
                floor = min(stage.max_replicas, math.ceil(ratio * partner - _EPS))
                if floor > result[name] + _EPS:
                    result[name] = float(floor)
                    changed = True
        if not changed:
            break
    return result


def decide(stages: Mapping[str, StageLoad], config: PolicyConfig) -> dict[str, float]:
    """The whole policy as a pure function: stage name -> wanted replicas, within each stage's bounds."""
    wanted = {name: wanted_replicas(s, config.waiting_threshold(name)) for name, s in stages.items()}
    wanted = apply_min_ratios(stages, wanted, config.min_ratios)
    # Serve bounds the result again; bounding here keeps the recorded policy state truthful.
    return {
        name: max(float(stages[name].min_replicas), min(float(stages[name].max_replicas), w))
        for name, w in wanted.items()
    }


def stage_load(ctx: Any) -> StageLoad:
    """A :class:`StageLoad` from Serve's ``AutoscalingContext``."""
    config = ctx.config
    target_ongoing = float(config.get_target_ongoing_requests())
    waiting = None
    metrics = ctx.aggregated_metrics or {}
    per_replica = metrics.get(ENGINE_WAITING) or {}
    if per_replica:
        waiting = sum(per_replica.values()) / len(per_replica)
    return StageLoad(
        name=ctx.deployment_name,
        running_replicas=ctx.current_num_replicas,
        target_replicas=ctx.target_num_replicas,
        ongoing=float(ctx.total_num_requests),
        target_ongoing=target_ongoing,
        min_replicas=ctx.capacity_adjusted_min_replicas,
        max_replicas=ctx.capacity_adjusted_max_replicas,
        engine_waiting=waiting,
    )


class StagePolicy:
    """Serve 2.60 application-level policy: ``policy_function: omni_serve.graph.autoscaling:StagePolicy``.

    Called with ``{DeploymentID: AutoscalingContext}``; returns
    ``({DeploymentID: wanted replicas}, {DeploymentID: policy state})``.
    """

    def __init__(self, min_ratios: Any = None, max_engine_waiting: Any = None):
        self.config = PolicyConfig.parse(min_ratios, max_engine_waiting)
        self._warned: set[str] = set()
        self._last: dict[str, tuple[int, float]] = {}  # stage -> (logged wanted count, when)

    def __call__(self, contexts: Mapping[Any, Any]) -> tuple[dict[Any, float], dict[Any, dict[str, Any]]]:
        ids = {ctx.deployment_name: dep_id for dep_id, ctx in contexts.items()}
        stages = {name: stage_load(contexts[dep_id]) for name, dep_id in ids.items()}
        self._warn_unknown(stages)
        wanted = decide(stages, self.config)
        self._log_changes(stages, wanted)
        state = {ids[name]: {"ongoing": stages[name].ongoing, "wanted": wanted[name]} for name in stages}
        return {ids[name]: value for name, value in wanted.items()}, state

    def _log_changes(self, stages: Mapping[str, StageLoad], wanted: Mapping[str, float]) -> None:
        """A controller log line when a stage's wanted replica count changes, with the reason.

        At most one line per stage per LOG_INTERVAL_S (Serve calls the policy every 0.1 s): a
        wish that flips back within that time is not logged, a lasting one is, a little later.
        """
        now = time.monotonic()
        for name, stage in stages.items():
            count = math.ceil(wanted[name] - _EPS)
            last_count, last_time = self._last.get(name, (None, -math.inf))
            if last_count == count or now - last_time < LOG_INTERVAL_S:
                continue
            self._last[name] = (count, now)
            own = wanted_replicas(stage, self.config.waiting_threshold(name))
            logger.info(
                "omni_serve autoscaling: %s wants %d replica(s) (running %d; ongoing %.1f / target %.1f%s%s)",
                name,
                count,
                stage.running_replicas,
                stage.ongoing,
                stage.target_ongoing,
                "" if stage.engine_waiting is None else f"; engine_waiting {stage.engine_waiting:.1f}",
                "; raised by min_ratios" if math.ceil(own - _EPS) < count and count > stage.min_replicas else "",
            )

    def _warn_unknown(self, stages: Mapping[str, StageLoad]) -> None:
        named = set(self.config.min_ratios) | {o for p in self.config.min_ratios.values() for o in p}
        named |= set(self.config.max_engine_waiting) - {ALL_STAGES}
        for name in sorted(named - set(stages) - self._warned):
            self._warned.add(name)
            logger.warning(
                "omni_serve autoscaling: policy_kwargs name stage %r, which has no autoscaled deployment "
                "in this application (stages: %s); its rules are ignored",
                name,
                sorted(stages),
            )
