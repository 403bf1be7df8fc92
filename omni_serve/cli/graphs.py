"""Graph files generated from vLLM-Omni's own deploy configs.

    python -m omni_serve.cli.graphs from-vllm-omni qwen3_omni_moe -o graphs/qwen3_omni.yaml
    python -m omni_serve.cli.graphs from-vllm-omni path/to/deploy.yaml --pipeline qwen3_omni_moe --model ORG/NAME

vLLM-Omni describes a model twice: its topology in code (``PipelineConfig``: stages,
edges, model_stage, worker/scheduler, stage input processors, sampling constraints)
and its deployment in a deploy YAML (per-stage memory fractions, batch sizes,
sampling defaults, devices, platform overrides). vLLM-Omni merges the two with
``merge_pipeline_deploy``; this module runs that same merge and writes the result
as a Ray Serve config: graph semantics in ``args`` (one ``vllm_omni`` stage per
vLLM-Omni stage), placement in ``deployments:``.

What changes on the way, and why:
- ``devices`` are dropped; Ray assigns GPUs. Stages that share a device in the
  deploy config get fractional ``num_gpus`` equal to their ``gpu_memory_utilization``
  (so Ray packs them on one GPU as vLLM-Omni would); a stage alone on its devices
  gets whole GPUs. Tensor parallel > 1 becomes one placement-group bundle with that
  many GPUs and ``distributed_executor_backend: mp`` (the Ray executor loses the
  placement group under Serve).
- Each stage runs standalone (no connectors): handoffs travel through the Ray
  object store, so the connector-only knobs are switched off in the engine args
  (``async_chunk``, ``requires_full_payload_input``, the worker-side
  next-stage hook). Codec streaming keeps the connector's chunk sizes, in
  ``engine_args.codec_chunk``.
- Sampling keys omni_serve models go to ``default_sampling``; the pipeline's
  sampling constraints (e.g. the talker's stop token) to ``engine_args``, applied
  on every request as vLLM-Omni does.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from omni_serve.engines import reads_streamed_input
from omni_serve.models.vllm_omni_handoffs import PIPELINES
from omni_serve.types import SAMPLING_EXTENSIONS, SamplingParams

# Engine args that only make sense with vLLM-Omni's in-process connectors.
STANDALONE_ENGINE_ARGS: dict[str, Any] = {"async_chunk": False, "requires_full_payload_input": False}
CONNECTOR_ONLY_ENGINE_ARGS = ("custom_process_next_stage_input_func",)
# Emitted by vLLM-Omni's merge for every stage, read only by its diffusion stage runtime.
DIFFUSION_ONLY_ENGINE_ARGS = ("inline_diffusion",)
# Fields owned by omni_serve's typed EngineArgs, or by topology rather than the engine.
TOPOLOGY_ENGINE_ARGS = ("model", "model_stage", "final_output", "devices")
CODEC_CHUNK_KEYS = {
    "codec_chunk_frames": "chunk_frames",
    "codec_left_context_frames": "left_context_frames",
    "initial_codec_chunk_frames": "initial_chunk_frames",
}

# Multi-node placement (cluster.yaml, deploy/kuberay.yaml): each node type advertises a marker
# custom resource and a stage asks for a sliver of its node type's marker, so Ray places it only
# there. Ray's autoscalers (v1 and v2, and KubeRay's) launch the node type that supplies a
# pending resource; label selectors are not honoured by the v1 autoscaler.
NODE_RESOURCES: dict[str, dict[str, str]] = {
    "qwen3_omni_moe": {"thinker": "omni_gpu_big", "talker": "omni_gpu_shared", "code2wav": "omni_gpu_shared"},
}
NODE_RESOURCE_PER_REPLICA = 0.01  # a node type advertises 1: room for 100 replicas, the GPUs bind first
# Application-level autoscaling (omni_serve.graph.autoscaling): at least one code2wav replica per two talkers.
MIN_RATIOS = {"code2wav": {"talker": 0.5}}

# Serve defaults the deploy config has no word for; the graph header says so.
HTTP_OPTIONS = {"host": "0.0.0.0", "port": 8000, "request_timeout_s": 600}
STAGE_TIMEOUT_S = 540  # below request_timeout_s (omni_serve.graph.config.check_timeouts): the client gets the 504
# OpenAI's voice names -> the model's speakers (female / male voices to the closest timbre).
VOICE_ALIASES: dict[str, dict[str, str]] = {
    "qwen3_omni_moe": {
        **dict.fromkeys(["alloy", "coral", "marin", "nova", "sage", "shimmer"], "chelsie"),
        **dict.fromkeys(["ash", "cedar", "echo", "onyx", "verse"], "ethan"),
        **dict.fromkeys(["ballad", "fable"], "aiden"),
    },
    "qwen2_5_omni": {
        **dict.fromkeys(["alloy", "coral", "marin", "nova", "sage", "shimmer"], "chelsie"),
        **dict.fromkeys(["ash", "ballad", "cedar", "echo", "fable", "onyx", "verse"], "ethan"),
    },
}
INGRESS = {"name": "ingress", "max_ongoing_requests": 256, "ray_actor_options": {"num_cpus": 1}}
STAGE_CPUS = 2


def _import(path: str) -> Any:
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def deploy_dir() -> Path:
    import vllm_omni

    return Path(vllm_omni.__file__).parent / "deploy"


def resolve_source(source: str, pipeline: str | None) -> tuple[str, Path]:
    """(pipeline model_type, deploy YAML) for a pipeline name, a known model id, or a deploy YAML path."""
    path = Path(source)
    if source.endswith((".yaml", ".yml")):
        if not path.exists():
            path = deploy_dir() / source
        if not path.exists():
            raise SystemExit(f"deploy config not found: {source}")
        declared = (yaml.safe_load(path.read_text()) or {}).get("pipeline")
        pipeline = pipeline or declared or path.stem
    else:
        by_model = {p.default_model.lower(): name for name, p in PIPELINES.items()}
        pipeline = pipeline or by_model.get(source.lower(), source)
        path = None  # type: ignore[assignment]  # a model id or pipeline name: no deploy YAML file
    if pipeline not in PIPELINES:
        raise SystemExit(
            f"no omni_serve handoffs for pipeline {pipeline!r}; supported: {sorted(PIPELINES)} "
            "(pass --pipeline for a deploy YAML whose file name is not the pipeline name)"
        )
    if path is None:
        path = deploy_dir() / _import(PIPELINES[pipeline].topology).default_deploy_config_name
    return pipeline, path


def merged_stages(pipeline: str, deploy_path: Path, platform: str) -> tuple[list[Any], Any]:
    """vLLM-Omni's own merge of topology + deploy config, with ``platform``'s overrides applied."""
    from vllm_omni.config import stage_config as sc

    deploy = sc.load_deploy_config(deploy_path)
    # merge_pipeline_deploy applies the overrides of the platform it runs on; a graph
    # is generated for the cluster's platform instead, so apply those first and clear
    # the section (private helper: vLLM-Omni has no public "merge for platform X").
    deploy = sc._apply_platform_overrides(deploy, platform)
    deploy.platforms = None
    # Stages run standalone, fed by the object store: merge them as vLLM-Omni's
    # non-async-chunk path (which picks the consumer-side processors, e.g.
    # thinker2talker_token_only); the returned deploy keeps async_chunk and the
    # connector's codec chunk sizes for the talker's own streaming.
    standalone = copy.deepcopy(deploy)
    standalone.async_chunk = False
    return sc.merge_pipeline_deploy(_import(PIPELINES[pipeline].topology), standalone), deploy


def _plain(value: Any) -> Any:
    """OmegaConf / tuples -> plain YAML-safe Python."""
    from vllm_omni.config.yaml_util import to_dict

    if hasattr(value, "items") and not isinstance(value, dict):
        value = to_dict(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _split_sampling(merged: dict[str, Any], constraints: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(omni_serve default_sampling, constraints applied on every request)."""
    # vLLM's extra parameters stay vLLM-Omni constraints: the engine applies them as vLLM-Omni does.
    known = set(SamplingParams.model_fields) - set(SAMPLING_EXTENSIONS)
    sampling: dict[str, Any] = {}
    extra = dict(constraints)
    for key, value in merged.items():
        if key in constraints:
            continue
        if key == "top_k" and value == -1:
            value = 0  # both mean "disabled"
        if key in known:
            sampling[key] = value
        else:
            extra[key] = value
    return sampling, extra


def _codec_chunk(deploy: Any, stage: Any) -> dict[str, int] | None:
    """Chunk sizes of the connector that carries this stage's codec output, if it streams."""
    if not deploy.async_chunk or stage.model_stage != "talker":
        return None
    for spec in (deploy.connectors or {}).values():
        extra = (spec or {}).get("extra") or {}
        found = {ours: int(extra[theirs]) for theirs, ours in CODEC_CHUNK_KEYS.items() if theirs in extra}
        if found:
            return found
    return None


def _devices(stage: Any) -> str | None:
    devices = (stage.yaml_runtime or {}).get("devices")
    return None if devices is None else str(devices)


def _deployment(stage: Any, engine: dict[str, Any], shared: bool, num_replicas: int) -> dict[str, Any]:
    tp = int(engine.get("tensor_parallel_size") or 1)
    seqs = int(engine.get("max_num_seqs") or 1)
    entry: dict[str, Any] = {"name": stage.model_stage, "max_ongoing_requests": seqs}
    if tp > 1:
        # One bundle holding all TP GPUs: the replica and vLLM's mp workers share it.
        entry["ray_actor_options"] = {"num_cpus": STAGE_CPUS, "num_gpus": tp}
        entry["placement_group_bundles"] = [{"CPU": STAGE_CPUS, "GPU": tp}]
        entry["placement_group_strategy"] = "STRICT_PACK"
    elif shared:
        entry["ray_actor_options"] = {"num_cpus": STAGE_CPUS, "num_gpus": float(engine["gpu_memory_utilization"])}
    else:
        entry["ray_actor_options"] = {"num_cpus": STAGE_CPUS, "num_gpus": 1}
    entry["autoscaling_config"] = {
        "min_replicas": num_replicas,
        "initial_replicas": num_replicas,
        "max_replicas": 2 * num_replicas,
        # The engine batches up to max_num_seqs; add a replica at half that.
        "target_ongoing_requests": max(1, seqs // 2),
        "upscale_delay_s": 30,
        "downscale_delay_s": 600,
    }
    return entry


def _autoscaling_policy(stages: set[str]) -> dict[str, Any]:
    ratios = {
        stage: {other: r for other, r in partners.items() if other in stages}
        for stage, partners in MIN_RATIOS.items()
        if stage in stages and any(other in stages for other in partners)
    }
    return {
        "policy_function": "omni_serve.graph.autoscaling:StagePolicy",
        "policy_kwargs": {"min_ratios": ratios} if ratios else {},
    }


def generate(
    source: str, *, model: str | None = None, pipeline: str | None = None, platform: str = "cuda"
) -> dict[str, Any]:
    """The Serve config (as a dict) for one vLLM-Omni pipeline + deploy config."""
    pipeline, deploy_path = resolve_source(source, pipeline)
    model = model or PIPELINES[pipeline].default_model
    stages, deploy = merged_stages(pipeline, deploy_path, platform)
    names = {s.stage_id: s.model_stage for s in stages}
    device_users: dict[str, int] = {}
    for s in stages:
        if (devices := _devices(s)) is not None:
            device_users[devices] = device_users.get(devices, 0) + 1

    def streams(engine_args: dict[str, Any]) -> bool:
        return reads_streamed_input("vllm_omni", engine_args)

    graph_stages: list[dict[str, Any]] = []
    deployments: list[dict[str, Any]] = [INGRESS]
    for s in stages:
        omega = _plain(s.to_omegaconf())
        engine = {k: v for k, v in omega["engine_args"].items() if v is not None}
        for key in (*TOPOLOGY_ENGINE_ARGS, *CONNECTOR_ONLY_ENGINE_ARGS, *DIFFUSION_ONLY_ENGINE_ARGS):
            engine.pop(key, None)
        engine.update(STANDALONE_ENGINE_ARGS)
        if int(engine.get("tensor_parallel_size") or 1) > 1:
            engine["distributed_executor_backend"] = "mp"
        if len(s.input_sources) > 1:
            raise SystemExit(f"stage {s.model_stage}: several inputs {s.input_sources} are not supported")
        sampling, constraints = _split_sampling(
            omega.get("default_sampling_params") or {}, omega.get("sampling_constraints") or {}
        )
        engine_args: dict[str, Any] = {
            "model": model,
            "pipeline": pipeline,
            "stage_id": s.stage_id,
            "model_stage": s.model_stage,
            "engine_input_source": list(s.input_sources),
            "final_output_type": s.final_output_type if s.final_output else None,
            "is_comprehension": bool(s.is_comprehension),
            "requires_multimodal_data": bool((s.yaml_runtime or {}).get("requires_multimodal_data", False)),
            "custom_process_input_func": s.custom_process_input_func,
            "sampling_constraints": constraints,
            "codec_chunk": _codec_chunk(deploy, s),
            # The stage that reads the chat parses tool calls from its output with the model family's parser.
            "tool_call_parser": PIPELINES[pipeline].tool_call_parser if s.is_comprehension else None,
            "engine": engine,
        }
        graph_stages.append(
            {
                "name": s.model_stage,
                "engine": "vllm_omni",
                **({"input": names[s.input_sources[0]]} if s.input_sources else {}),
                "engine_args": {k: v for k, v in engine_args.items() if v is not None},
                # vLLM-Omni's async_chunk streams the thinker into the talker: here the talker's stream_input.
                **({"stream_input": True} if s.input_sources and deploy.async_chunk and streams(engine_args) else {}),
                **({"final_output": s.final_output_type} if s.final_output else {}),
                "default_sampling": sampling,
            }
        )
        devices = _devices(s)
        shared = devices is not None and device_users[devices] > 1
        deployments.append(_deployment(s, engine, shared, int((s.yaml_runtime or {}).get("num_replicas", 1))))
        node_resource = NODE_RESOURCES.get(pipeline, {}).get(s.model_stage)
        if node_resource:
            deployments[-1]["ray_actor_options"]["resources"] = {node_resource: NODE_RESOURCE_PER_REPLICA}

    return {
        "proxy_location": "EveryNode",
        "http_options": dict(HTTP_OPTIONS),
        "applications": [
            {
                "name": "omni",
                "route_prefix": "/",
                "import_path": "omni_serve.app:build_app",
                "args": {
                    "served_model_name": model,
                    "stages": graph_stages,
                    "stage_timeout_s": STAGE_TIMEOUT_S,
                    **({"voice_aliases": VOICE_ALIASES[pipeline]} if pipeline in VOICE_ALIASES else {}),
                },
                "autoscaling_policy": _autoscaling_policy({s["name"] for s in graph_stages}),
                "deployments": deployments,
            }
        ],
    }


def gpus_needed(config: dict[str, Any]) -> int:
    """Physical GPUs for the minimum replicas: whole-GPU stages plus fractional ones packed together."""
    import math

    whole, shared = 0, 0.0
    for d in config["applications"][0]["deployments"]:
        gpus = float(d.get("ray_actor_options", {}).get("num_gpus", 0))
        replicas = d.get("autoscaling_config", {}).get("min_replicas", 1)
        if gpus >= 1:
            whole += int(gpus) * replicas
        else:
            shared += gpus * replicas
    return whole + math.ceil(round(shared, 6))


def _placement_header(app: dict[str, Any], output: str | None) -> list[str]:
    pins = sorted({r for d in app["deployments"] for r in d.get("ray_actor_options", {}).get("resources", {})})
    if not pins:
        return []
    advertise = json.dumps({r: 1 for r in pins}, separators=(",", ":"))
    return [
        f"# Stages are pinned to node types by custom resources ({', '.join(pins)}; cluster.yaml and",
        "# deploy/kuberay.yaml define the node types). On one machine, advertise them all:",
        f"#   ray start --head --resources='{advertise}' && serve deploy {output or 'THIS_FILE.yaml'}",
    ]


def header(config: dict[str, Any], command: str, deploy_path: Path, output: str | None) -> str:
    import vllm_omni

    app = config["applications"][0]
    lines = [
        f"# {app['args']['served_model_name']} on vLLM-Omni {getattr(vllm_omni, '__version__', '?')} stage engines,",
        "# one Ray Serve deployment per stage. Generated, then only these comments edited:",
        f"#   {command}",
        f"# from vLLM-Omni's pipeline topology + deploy config {deploy_path.parent.name}/{deploy_path.name}.",
        "# GPUs (one replica per stage): "
        + ", ".join(
            f"{d['name']} {d['ray_actor_options']['num_gpus']}" for d in app["deployments"] if d["name"] != "ingress"
        )
        + f" -> {gpus_needed(config)} GPU(s).",
        "# Stages with fractional num_gpus share a GPU as in the deploy config; each one's vLLM",
        "# gpu_memory_utilization equals its fraction. Needs: pip install 'omni_serve[vllm]' on the nodes.",
        *(_placement_header(app, output) or [f"#   serve run {output or 'THIS_FILE.yaml'}"]),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_serve.cli.graphs", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("from-vllm-omni", help="write a graph from a vLLM-Omni pipeline / deploy config")
    gen.add_argument("source", help="pipeline model_type (qwen3_omni_moe), model id, or deploy YAML path")
    gen.add_argument("-o", "--output", help="graph file to write (default: stdout)")
    gen.add_argument("--model", help="HF model id or local path served (default: the pipeline's reference model)")
    gen.add_argument("--pipeline", help="vLLM-Omni pipeline model_type, when the source does not name it")
    gen.add_argument("--platform", default="cuda", help="platform section of the deploy config to apply")
    args = parser.parse_args(argv)

    config = generate(args.source, model=args.model, pipeline=args.pipeline, platform=args.platform)
    _, deploy_path = resolve_source(args.source, args.pipeline)
    command = "python -m omni_serve.cli.graphs " + " ".join(argv if argv is not None else sys.argv[1:])
    text = header(config, command, deploy_path, args.output) + yaml.safe_dump(config, sort_keys=False, width=120)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
