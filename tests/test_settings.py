"""Run-time settings (omni_serve.graph.settings): what a deployment's user_config overrides, and what it refuses.

In process, on the tiny graph's args and unstarted stages (fast; no cluster). On a cluster: tests/test_auth.py
(the key and realtime limits set and removed on the running replicas, none restarted), tests/test_timeouts.py
(the stage timeout and the talker's pacing), tests/test_isolation.py (pacing from a replica's start) and
tests/test_faults.py (handoff padding); the pacing of real calls: tests/test_engine_pacing.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from omni_serve.cli.launch import load_graph_file
from omni_serve.graph.config import GraphConfigError, load_graph
from omni_serve.graph.settings import ingress_graph
from omni_serve.graph.stage import Stage

REQUEST_TIMEOUT_S = 120.0  # the tiny graph's http_options.request_timeout_s


def tiny_args() -> dict[str, Any]:
    """The tiny graph's args as the ingress gets them (build_app's dump of the validated graph)."""
    return load_graph(load_graph_file("tiny_omni.yaml")["applications"][0]["args"]).model_dump(mode="json")


def test_no_user_config_is_the_args() -> None:
    args = tiny_args()
    assert ingress_graph(args, None, REQUEST_TIMEOUT_S) == load_graph(args)


def test_the_ingress_settings_override_the_args_and_realtime_merges_key_by_key() -> None:
    args = tiny_args()
    args["realtime"]["max_items"] = 7  # not the default: a merge keeps it, a replaced realtime would not
    user_config = {"api_key": "sk-new", "stage_timeout_s": 4, "realtime": {"allowed_origins": ["https://a.example"]}}
    graph = ingress_graph(args, user_config, REQUEST_TIMEOUT_S)
    assert (graph.api_key, graph.stage_timeout_s) == ("sk-new", 4.0)
    assert graph.realtime.allowed_origins == ["https://a.example"]
    # The other realtime limits stay the args' (a partial realtime does not reset them to the defaults).
    untouched = load_graph(args).realtime.model_dump(exclude={"allowed_origins"})
    assert graph.realtime.model_dump(exclude={"allowed_origins"}) == untouched and graph.realtime.max_items == 7
    assert graph.stages == load_graph(args).stages


@pytest.mark.parametrize(
    ("user_config", "says"),
    [
        ({"max_request_bytes": 1 << 20}, "max_request_bytes is not a run-time setting"),
        ({"stages": []}, "stages is not a run-time setting"),
        ({"stage_timeout_s": 0}, "stage_timeout_s"),
        ({"stage_timeout_s": 119}, "stage_timeout_s (119 s) must be at most http_options.request_timeout_s"),
        ({"api_key": ""}, "api_key"),
        ({"realtime": {"max_sessions": 2}}, "realtime.max_sessions sizes the replica's sessions"),
        ({"realtime": {"audio_workers": 2}}, "realtime.audio_workers"),
        ({"realtime": {"max_items": 1}}, "realtime.max_items"),
        ({"realtime": {"no_such_limit": 1}}, "realtime.no_such_limit"),
        (["api_key"], "a mapping of run-time settings"),
    ],
    ids=[
        "args-field",
        "stages",
        "timeout-0",
        "over-serve-timeout",
        "empty-key",
        "max-sessions",
        "audio-workers",
        "realtime-range",
        "realtime-unknown",
        "not-a-mapping",
    ],
)
def test_anything_else_is_refused_naming_the_field(user_config: Any, says: str) -> None:
    with pytest.raises(GraphConfigError, match="user_config of deployment 'ingress'|stage_timeout_s") as caught:
        ingress_graph(tiny_args(), user_config, REQUEST_TIMEOUT_S)
    assert says in str(caught.value)


def stage(engine: str = "transformers", **engine_args: Any) -> Stage:
    """An unstarted stage (its engine built, nothing loaded)."""
    base = {"model_stage": "talker"} if engine == "transformers" else {"model": "unused"}
    return Stage({"name": "talker", "engine": engine, "engine_args": {**base, **engine_args}, "final_output": "text"})


def test_a_stage_takes_pacing_and_padding_and_none_restores_its_own() -> None:
    talker = stage(min_step_s=0.25)
    talker.configure({"min_step_s": 0.5, "handoff_padding_bytes": 1024})
    assert (talker.engine.args.min_step_s, talker.padding) == (0.5, 1024)  # type: ignore[attr-defined]
    talker.configure({"handoff_padding_bytes": 8})  # pacing left out: back to the engine args'
    assert (talker.engine.args.min_step_s, talker.padding) == (0.25, 8)  # type: ignore[attr-defined]
    talker.configure(None)
    assert (talker.engine.args.min_step_s, talker.padding) == (0.25, 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("user_config", "says"),
    [
        ({"min_step_s": 11}, "min_step_s"),
        ({"handoff_padding_bytes": -1}, "handoff_padding_bytes"),
        ({"stream_input": False}, "stream_input is not a run-time setting"),
    ],
    ids=["pace-out-of-range", "negative-padding", "args-field"],
)
def test_a_stage_refuses_the_rest_naming_the_field(user_config: dict[str, Any], says: str) -> None:
    talker = stage()
    with pytest.raises(GraphConfigError, match="user_config of deployment 'talker'") as caught:
        talker.configure(user_config)
    assert says in str(caught.value)
    assert (talker.engine.args.min_step_s, talker.padding) == (0.0, 0)  # type: ignore[attr-defined]


def test_a_family_that_paces_in_its_engine_processes_refuses_pacing_at_run_time() -> None:
    """vLLM's steps run in its EngineCore, paced by what it was started with (omni_serve.pacing)."""
    llm = stage("vllm")
    with pytest.raises(ValueError, match=r"user_config\.min_step_s: stage 'talker' \(VLLMEngine\).*engine_args"):
        llm.configure({"min_step_s": 0.1})
    llm.configure({"handoff_padding_bytes": 16})  # what it can take, it takes
    assert llm.padding == 16
