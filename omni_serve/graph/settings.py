"""Run-time settings: what a deployment's ``user_config`` changes on running replicas, without restarting them.

A graph file's ``args`` are part of its application's code version: Serve restarts every replica of the
application when they change (``ray.serve._private.deploy_utils.get_app_code_version``), engines included.
A deployment's ``user_config`` is not: Serve hands a changed one to each running replica's ``reconfigure``
in place, as it applies ``num_replicas``, ``max_ongoing_requests`` or ``autoscaling_config``. The settings
an operator changes on a live graph are taken there, each overriding the ``args`` value of the same name:

- the ingress (:class:`IngressSettings`): ``api_key`` and ``api_keys`` (rotate a key: a client given new keys
  under its name keeps its video jobs, :mod:`omni_serve.api.auth`), ``stage_timeout_s``, ``realtime`` (its
  limits, merged key by key over the args'; sessions opened after the change get them), all but the two that
  size the replica's session table and VAD threads when it starts, and ``videos`` (the jobs' limits, merged
  key by key too; the replica hands them to its jobs actor, and jobs admitted after the change get them);
- a stage (:class:`StageSettings`): ``min_step_s``, its engine's step pacing (:mod:`omni_serve.pacing`), for
  the families whose steps run in the replica's own process (``transformers``, ``diffusers``; the others pace
  inside their engine processes, set when those start, and refuse it), and ``handoff_padding_bytes``, the
  stage's debug padding of its handoffs. Calls already running keep what they started with.

A ``user_config`` removed returns the replica to the ``args`` values (the ``reconfigure`` hooks take Serve's
``rank``, so Serve calls them on that change too). Anything else in a ``user_config``, or a value out of
range, is refused naming the field: Serve takes the replica that refused it for failed, replaces it, and after
three refusals reports the deployment DEPLOY_FAILED with that message (docs/graphs.md). A graph with
``engine_in_ingress`` offers its ingress's settings only (its one stage runs in the ingress replica).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_serve.graph.config import GraphConfig, GraphConfigError, check_timeouts, format_errors
from omni_serve.pacing import min_step_field

Settings = TypeVar("Settings", bound=BaseModel)

# RealtimeConfig fields a running replica cannot take: they size its session table and VAD threads at start.
REALTIME_AT_START = frozenset({"max_sessions", "audio_workers"})


class IngressSettings(BaseModel):
    """The ingress deployment's ``user_config``; a field left out keeps the ``args`` value."""

    model_config = ConfigDict(extra="forbid")

    api_key: str | None = Field(None, min_length=1, description="Overrides args.api_key (a key rotated in place).")
    api_keys: dict[str, str | list[str]] | None = Field(
        None, description="Replaces args.api_keys, the whole ring (a client's keys rotated in place)."
    )
    stage_timeout_s: float | None = Field(None, gt=0, description="Overrides args.stage_timeout_s.")
    realtime: dict[str, Any] | None = Field(
        None, description="Merged key by key over args.realtime (but max_sessions and audio_workers)."
    )
    videos: dict[str, Any] | None = Field(None, description="Merged key by key over args.videos.")


class StageSettings(BaseModel):
    """A stage deployment's ``user_config``; a field left out keeps the stage's own (min_step_s: its engine_args')."""

    model_config = ConfigDict(extra="forbid")

    min_step_s: float | None = min_step_field(None)
    handoff_padding_bytes: int | None = Field(None, ge=0, description="Overrides the stage's handoff_padding_bytes.")


def parse(model: type[Settings], user_config: Any, deployment: str) -> Settings:
    """``user_config`` as ``model`` (None: nothing overridden); a ``GraphConfigError`` naming the field otherwise."""
    if user_config is None:
        return model()
    if not isinstance(user_config, dict):
        raise GraphConfigError(f"invalid user_config of deployment '{deployment}': a mapping of run-time settings")
    unknown = sorted(set(user_config) - set(model.model_fields))
    if unknown:
        raise GraphConfigError(
            f"invalid user_config of deployment '{deployment}': {unknown[0]} is not a run-time setting "
            f"(those are {', '.join(model.model_fields)}); set it in the graph's args, which restarts the replicas"
        )
    try:
        return model.model_validate(user_config)
    except ValidationError as err:
        raise GraphConfigError(f"invalid user_config of deployment '{deployment}': {format_errors(err)}") from None


def ingress_graph(args: dict[str, Any], user_config: Any, request_timeout_s: float | None) -> GraphConfig:
    """The graph ``args`` with the ingress's run-time settings over them, validated as the args are."""
    settings = parse(IngressSettings, user_config, "ingress")
    update = settings.model_dump(exclude_none=True)
    if "realtime" in update:
        at_start = sorted(set(update["realtime"]) & REALTIME_AT_START)
        if at_start:
            raise GraphConfigError(
                f"invalid user_config of deployment 'ingress': realtime.{at_start[0]} sizes the replica's sessions "
                "when it starts; set it in the graph's args, which restarts the replicas"
            )
        update["realtime"] = {**args.get("realtime", {}), **update["realtime"]}
    if "videos" in update:
        update["videos"] = {**args.get("videos", {}), **update["videos"]}
    try:
        graph = GraphConfig.model_validate({**args, **update})
    except ValidationError as err:
        raise GraphConfigError(f"invalid user_config of deployment 'ingress': {format_errors(err)}") from None
    check_timeouts(graph.stage_timeout_s, request_timeout_s)
    return graph
