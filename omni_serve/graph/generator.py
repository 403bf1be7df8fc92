"""The graph generator: a graph file (a Serve config) from vLLM-Omni's own pipeline declaration and deploy
config, for any pipeline; ``python -m omni_serve.cli.graphs`` is its command line.

vLLM-Omni describes a model twice: its topology in code (``PipelineConfig``, registered in
``OMNI_PIPELINES``: stages, inputs, execution types, processors, sampling constraints) and its
deployment in a deploy YAML (per-stage memory fractions, batch sizes, sampling defaults, devices,
platform overrides, connectors). A graph here is one ``vllm_omni`` stage per declared stage: its
``engine_args`` name the pipeline and stage id (the declaration builds the stage at start,
:mod:`omni_serve.engines.vllm_omni`) and carry the stage's deploy settings; placement goes to
``deployments:``. A pipeline that cannot be served is refused with the reason
(:func:`omni_serve.models.vllm_omni.refusals.refusal`).

What changes on the way, and why:
- ``devices`` are dropped; Ray assigns GPUs. Stages that share a device in the deploy config get
  fractional ``num_gpus`` equal to their ``gpu_memory_utilization`` (so Ray packs them on one GPU as
  vLLM-Omni would); a stage alone on its devices gets whole GPUs. Tensor parallel > 1 becomes one
  placement-group bundle with that many GPUs and ``distributed_executor_backend: mp`` (the Ray
  executor loses the placement group under Serve).
- Stages run without connectors: handoffs travel through the Ray object store, built by the
  pipeline's own processors in the replicas. Where the deploy config turns ``async_chunk`` on, an
  edge whose producer declares an async-chunk processor streams: into an autoregressive stage as its
  ``stream_input`` (where omni_serve knows that stage's streamed prompt), into a generation stage as
  chunks, one call each, cut with the connector's settings (``engine_args.chunks``, where omni_serve
  knows how a chunk's left context is cut: the decoder's frame geometry, or the decoder cuts it).
- Sampling keys omni_serve models go to ``default_sampling``; others the deploy config sets to
  ``engine_args.sampling_constraints``, applied on every request as vLLM-Omni does (with the
  pipeline's declared constraints, which the stage reads from the declaration).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from omni_serve.engines.vllm_omni.args import NOT_DEPLOY_KEYS
from omni_serve.types import SamplingParams

# A stage's deploy entry fields that are not its engine settings (placement, connectors, sampling).
DEPLOY_NOT_ENGINE = (
    "stage_id",
    "devices",
    "num_replicas",
    "env",
    "async_chunk",
    "output_connectors",
    "input_connectors",
    "default_sampling_params",
    "engine_extras",
)

# Multi-node placement (cluster.yaml, deploy/kuberay.yaml): each node type advertises a marker
# custom resource and a stage asks for a sliver of its node type's marker (PipelineHooks.node_resources), so
# Ray places it only there. Ray's autoscalers (v1 and v2, and KubeRay's) launch the node type that supplies a
# pending resource; label selectors are not honoured by the v1 autoscaler.
NODE_RESOURCE_PER_REPLICA = 0.01  # a node type advertises 1: room for 100 replicas, the GPUs bind first
# Application-level autoscaling (omni_serve.graph.autoscaling): at least one decoder (a generation stage)
# replica per two replicas of the autoregressive stage that feeds it.
DECODER_RATIO = 0.5

# Serve defaults the deploy config has no word for; the graph header says so.
HTTP_OPTIONS = {"host": "0.0.0.0", "port": 8000, "request_timeout_s": 600}
STAGE_TIMEOUT_S = 540  # below request_timeout_s (omni_serve.graph.config.check_timeouts): the client gets the 504
# The ingress runs its routes on its replica's own event loop: behind HAProxy, a client that stops reading
# then holds its request back (docs/design.md, "Flow control"); Serve's default thread queues the body.
INGRESS = {
    "name": "ingress",
    "max_ongoing_requests": 256,
    "ray_actor_options": {
        "num_cpus": 1,
        "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}},
    },
}
STAGE_CPUS = 2


class Refused(ValueError):
    """A pipeline or deploy config that cannot become a graph; the message says why."""


def deploy_dir() -> Path:
    import vllm_omni

    return Path(vllm_omni.__file__).parent / "deploy"


def _deploy_pipeline(path: Path) -> str | None:
    """The pipeline a deploy YAML is for: its ``pipeline:`` key, the pipeline whose default deploy config it (or a
    ``base_config`` it builds on) is, or the longest registered pipeline name its file name starts with."""
    from omni_serve.models.vllm_omni import pipelines

    raw, chain = yaml.safe_load(path.read_text()) or {}, [path.name]
    if raw.get("pipeline"):
        return str(raw["pipeline"])
    base, folder = raw.get("base_config"), path.parent
    while base:
        chain.append(Path(base).name)
        folder = (folder / base).parent
        base = (yaml.safe_load((folder / Path(base).name).read_text()) or {}).get("base_config")
    names = list(pipelines.registry())
    for name in chain:
        for key in names:
            if pipelines.pipeline(key).default_deploy_config_name == name:
                return key
    prefixed = [key for key in names if path.stem == key or path.stem.startswith(key + "_")]
    if prefixed:
        return max(prefixed, key=len)
    # vLLM-Omni picks a deploy config's pipeline from the checkpoint's config; the header comment of one
    # written for a checkpoint of another name names its architecture.
    comments = " ".join(line for line in path.read_text().splitlines() if line.lstrip().startswith("#"))
    archs = {pipelines.pipeline(key).model_arch: key for key in names if pipelines.pipeline(key).model_arch}
    named = {key for arch, key in archs.items() if f"({arch}" in comments or f" {arch}," in comments}
    return named.pop() if len(named) == 1 else None


def deploy_configs() -> list[Path]:
    """Every deploy YAML vLLM-Omni ships."""
    return sorted(deploy_dir().glob("*.yaml"))


def _turn_config_of(path: Path, pipeline: str) -> bool:
    try:
        return _deploy_pipeline(path) == pipeline and deploy_config(path, "cuda").session_mode == "turn"
    except Exception:  # a deploy config that does not load is no alternative
        return False


def resolve_source(source: str, pipeline: str | None) -> tuple[str, Path | None]:
    """(pipeline, deploy YAML or None) for a pipeline name, a reference model id, or a deploy YAML path."""
    from omni_serve.models.vllm_omni import pipelines

    if source.endswith((".yaml", ".yml")):
        path = Path(source)
        if not path.exists():
            path = deploy_dir() / source
        if not path.exists():
            raise Refused(f"deploy config not found: {source}")
        found = pipeline or _deploy_pipeline(path)
        if found is None:
            raise Refused(
                f"deploy config {path.name} names no pipeline (no pipeline: key, no pipeline's default deploy "
                "config or name it starts with, no architecture its comments name; vLLM-Omni picks it from the "
                "checkpoint's config): pass --pipeline"
            )
        return found, path
    by_model = {h.reference_model.lower(): name for name, h in pipelines.HOOKS.items() if h.reference_model}
    found = pipeline or by_model.get(source.lower(), source)
    if found not in pipelines.registry():
        raise Refused(f"no vLLM-Omni pipeline {found!r} (python -m omni_serve.cli.graphs list names them)")
    name = pipelines.pipeline(found).default_deploy_config_name
    return found, (deploy_dir() / name if name else None)


def deploy_config(path: Path | None, platform: str) -> Any:
    """The deploy config (vLLM-Omni's defaults without one), with ``platform``'s overrides applied.

    vLLM-Omni applies the overrides of the platform it runs on; a graph is generated for the cluster's
    platform instead, so they are applied here and the section cleared (private helper: vLLM-Omni has
    no public "merge for platform X").
    """
    from vllm_omni.config import stage_config as sc

    deploy = sc.load_deploy_config(path) if path is not None else sc.DeployConfig()
    deploy = sc._apply_platform_overrides(deploy, platform)
    deploy.platforms = None
    return deploy


def _split_sampling(defaults: dict[str, Any], constraints: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A deploy config's sampling defaults: (omni_serve default_sampling, others applied on every request).

    A default omni_serve models (vLLM's extra parameters too, e.g. Qwen3-TTS's ``min_tokens: 2``) stays a
    default a request may change, as a deploy default is in vLLM-Omni (a request's sampling params replace
    them); only what omni_serve does not model is applied on every request. The pipeline's declared
    constraints win over the deploy's defaults (as in vLLM-Omni's merge): the stage applies them from its
    declaration, so they are left out here.
    """
    known = set(SamplingParams.model_fields)
    sampling: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in defaults.items():
        if key in constraints:
            continue
        if key == "top_k" and value == -1:
            value = 0  # both mean "disabled"
        (sampling if key in known else extra)[key] = value
    return sampling, extra


def deploy_settings(deploy: Any, stage: Any | None) -> dict[str, Any]:
    """One stage's engine settings as its deploy entry gives them: the pipeline-wide ones, the stage's own
    (those it sets away from vLLM-Omni's defaults) and its engine extras; what the pipeline declares or
    omni_serve owns (NOT_DEPLOY_KEYS) left out."""
    from vllm_omni.config import stage_config as sc

    settings: dict[str, Any] = {}
    defaults = sc.DeployConfig()
    for name in sc.PIPELINE_WIDE_ENGINE_FIELDS:
        value = getattr(deploy, name)
        if value is not None and value != getattr(defaults, name, None):
            settings[name] = value
    if stage is not None:
        blank = sc.StageDeployConfig(stage_id=stage.stage_id)
        for field in dataclasses.fields(stage):
            value = getattr(stage, field.name)
            if field.name not in DEPLOY_NOT_ENGINE and value is not None and value != getattr(blank, field.name):
                settings[field.name] = value
        settings.update(stage.engine_extras)
    for key in NOT_DEPLOY_KEYS:
        settings.pop(key, None)
    if int(settings.get("tensor_parallel_size") or 1) > 1:
        settings["distributed_executor_backend"] = "mp"
    return _plain(settings)


def _plain(value: Any) -> Any:
    """Tuples, OmegaConf and enums -> plain YAML-safe Python."""
    if hasattr(value, "items") and not isinstance(value, dict):
        value = dict(value.items())
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "value", value) if hasattr(value, "value") and not isinstance(value, (int, float)) else value


def _connector_extra(deploy: Any, stage: Any | None) -> dict[str, Any]:
    """The ``extra`` of the connector carrying a stage's output (its output connector, else the only one)."""
    connectors = deploy.connectors or {}
    names = list((stage.output_connectors or {}).values()) if stage is not None else []
    spec = connectors.get(names[0]) if names else (next(iter(connectors.values())) if len(connectors) == 1 else None)
    return _plain(dict((spec or {}).get("extra") or {}))


def _devices(stage: Any | None) -> str | None:
    return None if stage is None or stage.devices is None else str(stage.devices)


def _deployment(
    name: str, engine: dict[str, Any], deploy_stage: Any | None, shared: bool, node_resource: str | None
) -> dict[str, Any]:
    """One stage's Serve deployment: its GPUs (whole, a TP bundle, or the fraction of a shared device), replicas,
    environment and node type."""
    num_replicas = deploy_stage.num_replicas if deploy_stage else 1
    tp = int(engine.get("tensor_parallel_size") or 1)
    seqs = int(engine.get("max_num_seqs") or 1)
    entry: dict[str, Any] = {"name": name, "max_ongoing_requests": seqs}
    if tp > 1:
        # One bundle holding all TP GPUs: the replica and vLLM's mp workers share it.
        entry["ray_actor_options"] = {"num_cpus": STAGE_CPUS, "num_gpus": tp}
        entry["placement_group_bundles"] = [{"CPU": STAGE_CPUS, "GPU": tp}]
        entry["placement_group_strategy"] = "STRICT_PACK"
    elif shared and engine.get("gpu_memory_utilization") is not None:
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
    if deploy_stage is not None and deploy_stage.env:
        env = {k: str(v) for k, v in deploy_stage.env.items()}
        entry["ray_actor_options"]["runtime_env"] = {"env_vars": env}
    if node_resource:
        entry["ray_actor_options"]["resources"] = {node_resource: NODE_RESOURCE_PER_REPLICA}
    return entry


def _autoscaling_policy(ratios: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {
        "policy_function": "omni_serve.graph.autoscaling:StagePolicy",
        "policy_kwargs": {"min_ratios": ratios} if ratios else {},
    }


def generate(
    source: str, *, model: str | None = None, pipeline: str | None = None, platform: str = "cuda"
) -> dict[str, Any]:
    """The Serve config (as a dict) for one vLLM-Omni pipeline + deploy config; :class:`Refused` with the reason
    when it cannot be served."""
    from omni_serve.models.vllm_omni import pipelines

    key, deploy_path = resolve_source(source, pipeline)
    declared, deploy = _servable(key, deploy_path, platform)
    hooks = pipelines.hooks(key)
    model = model or hooks.reference_model or key
    by_id = {s.stage_id: s for s in deploy.stages}
    names = _stage_names(declared)
    shared = _shared_devices(declared, by_id)
    entry_prompt = pipelines.entry_prompt(declared)

    graph_stages: list[dict[str, Any]] = []
    deployments: list[dict[str, Any]] = [INGRESS]
    for s in declared.stages:
        ds = by_id.get(s.stage_id)
        engine = deploy_settings(deploy, ds)
        if pipelines.family(s) == "vllm_omni_diffusion":
            graph_stages.append(_diffusion_stage(key, model, s, names, engine, ds))
        else:
            graph_stages.append(_vllm_omni_stage(key, declared, deploy, s, names, model, engine, ds, entry_prompt))
        node_resource = hooks.node_resources.get(s.model_stage)
        deployments.append(_deployment(names[s.stage_id], engine, ds, _devices(ds) in shared, node_resource))

    args: dict[str, Any] = {"served_model_name": model, "stages": graph_stages, "stage_timeout_s": STAGE_TIMEOUT_S}
    if hooks.voice_aliases:
        args["voice_aliases"] = dict(hooks.voice_aliases)
    if refused := refused_routes(declared):
        args["refused_routes"] = refused
    return {
        "proxy_location": "EveryNode",
        "http_options": dict(HTTP_OPTIONS),
        "applications": [
            {
                "name": "omni",
                "route_prefix": "/",
                "import_path": "omni_serve.app:build_app",
                "args": args,
                "autoscaling_policy": _autoscaling_policy(_decoder_ratios(declared, names)),
                "deployments": deployments,
            }
        ],
    }


def refused_routes(declared: Any) -> dict[str, str]:
    """The pipeline's declared endpoint restrictions on routes omni_serve serves (a /v1/completions restriction
    has nothing to restrict here: omni_serve serves chat, not completions), with vLLM-Omni's reasons."""
    restricted = {r.capability.path: r.reason for r in declared.endpoint_restrictions}
    return {path: reason for path, reason in restricted.items() if path != "/v1/completions"}


def _servable(key: str, deploy_path: Path | None, platform: str) -> tuple[Any, Any]:
    """(declaration, deploy config) of pipeline ``key``, checked as vLLM-Omni merges them and as omni_serve can
    serve them; :class:`Refused` with the reason (and the pipeline's turn-based deploy configs, if any) if not."""
    from vllm_omni.config import stage_config as sc

    from omni_serve.models.vllm_omni import pipelines, refusals

    declared = pipelines.pipeline(key)
    where = f"pipeline {key}" + (f" with {deploy_path.name}" if deploy_path is not None else "")
    try:
        deploy = deploy_config(deploy_path, platform)
        # vLLM-Omni's own merge validates the pair (stage ids, async-chunk edges); the graph is built from it.
        sc.merge_pipeline_deploy(declared, dataclasses.replace(deploy, platforms=None))
    except (ValueError, KeyError, TypeError, FileNotFoundError) as err:
        raise Refused(f"{where}: vLLM-Omni cannot merge it: {err}") from None
    reason = refusals.refusal(declared, deploy)
    if reason is None and (unknown := {s.stage_id for s in deploy.stages} - {s.stage_id for s in declared.stages}):
        reason = f"the deploy config has stages {sorted(unknown)} the pipeline does not declare"
    if reason is not None and deploy.session_mode != "turn":
        turns = [p.name for p in deploy_configs() if p != deploy_path and _turn_config_of(p, key)]
        reason += f" (turn-based deploy configs of it: {', '.join(turns)})" if turns else ""
    if reason is not None:
        raise Refused(f"{where}: cannot be served: {reason}")
    return declared, deploy


def _stage_names(declared: Any) -> dict[int, str]:
    """Each stage's deployment name: its ``model_stage``, with its stage id where two stages share one."""
    model_stages = [s.model_stage for s in declared.stages]
    return {
        s.stage_id: s.model_stage if model_stages.count(s.model_stage) == 1 else f"{s.model_stage}_{s.stage_id}"
        for s in declared.stages
    }


def _shared_devices(declared: Any, by_id: dict[int, Any]) -> set[str]:
    """The deploy config's device sets that more than one stage runs on (their stages get fractional GPUs)."""
    users: dict[str, int] = {}
    for s in declared.stages:
        if (devices := _devices(by_id.get(s.stage_id))) is not None:
            users[devices] = users.get(devices, 0) + 1
    return {devices for devices, count in users.items() if count > 1}


def _decoder_ratios(declared: Any, names: dict[int, str]) -> dict[str, dict[str, float]]:
    """The autoscaling policy's minimum ratios: a generation stage fed by one autoregressive stage keeps
    DECODER_RATIO replicas per replica of it."""
    from omni_serve.models.vllm_omni import pipelines

    ratios: dict[str, dict[str, float]] = {}
    for s in declared.stages:
        if pipelines.kind(s) == "generation" and len(s.input_sources) == 1:
            (upstream,) = s.input_sources
            if pipelines.kind(declared.get_stage(upstream)) == "autoregressive":
                ratios[names[s.stage_id]] = {names[upstream]: DECODER_RATIO}
    return ratios


def _vllm_omni_stage(
    key: str,
    declared: Any,
    deploy: Any,
    s: Any,
    names: dict[int, str],
    model: str,
    engine: dict[str, Any],
    ds: Any,
    entry_prompt: str,
) -> dict[str, Any]:
    """An llm_ar / llm_generation stage (``vllm_omni``) of pipeline ``key``: its declaration named, its deploy
    settings and sampling (``entry_prompt``: what the pipeline's entry stage builds its prompt from)."""
    from omni_serve.models.vllm_omni import pipelines

    sampling, extra = _split_sampling(dict((ds and ds.default_sampling_params) or {}), s.sampling_constraints)
    engine_args: dict[str, Any] = {"model": model, "pipeline": key, "stage_id": s.stage_id}
    if not s.input_sources:
        if entry_prompt != "chat":
            engine_args["entry"] = entry_prompt
        media = pipelines.entry_media(declared)
        if entry_prompt == "image":  # an image request carries at most the image to edit
            media = [m for m in media if m == "image"]
        if media:
            engine_args["media"] = media
        # A chat entry stage parses tool calls from its output with the model family's parser (a hook).
        if entry_prompt == "chat" and (parser := pipelines.hooks(key).tool_call_parser):
            engine_args["tool_call_parser"] = parser
    if extra:
        engine_args["sampling_constraints"] = extra
    stage: dict[str, Any] = {"name": names[s.stage_id], "engine": "vllm_omni"}
    if s.input_sources:
        stage["inputs"] = [names[i] for i in s.input_sources]
    chunks = _chunks(declared, deploy, s)
    if chunks is not None:
        engine_args["chunks"] = chunks
    engine_args["engine"] = engine
    stage["engine_args"] = engine_args
    if _streams(declared, deploy, s):
        stage["stream_input"] = True
    if s.final_output:
        stage["final_output"] = s.final_output_type
    stage["default_sampling"] = sampling
    return stage


# Deploy settings of a DiT stage -> the vllm_omni_diffusion family's engine_args (the parallel ones nested).
DIFFUSION_SETTINGS = (
    "dtype",
    "max_num_seqs",
    "request_batch_max_wait_ms",
    "enforce_eager",
    "diffusion_compile_granularity",
    "diffusion_compile_dynamic",
    "step_execution",
    "enable_cpu_offload",
    "enable_layerwise_offload",
    "vae_use_slicing",
    "vae_use_tiling",
)
DIFFUSION_PARALLEL = (
    "tensor_parallel_size",
    "ulysses_degree",
    "ring_degree",
    "ulysses_mode",
    "cfg_parallel_size",
    "vae_patch_parallel_size",
)
# vLLM engine settings deploy configs repeat on their DiT stages (pipeline-wide ones included) that
# vLLM-Omni's DiffusionEngine does not read either: no KV cache, no token batches, no remote code.
LLM_ONLY_SETTINGS = (
    "trust_remote_code",
    "enable_prefix_caching",
    "max_num_batched_tokens",
    "max_model_len",
    "gpu_memory_utilization",
    "distributed_executor_backend",
    "async_scheduling",
)
# A DiT stage's deploy sampling defaults -> its engine_args defaults. Its seed is the request's (drawn when
# none is sent), the one its AR stage ran with, as vLLM-Omni's API sends one seed to both.
DIFFUSION_DEFAULTS = {
    "num_inference_steps": "default_num_inference_steps",
    "guidance_scale": "default_guidance_scale",
    "height": "default_height",
    "width": "default_width",
    "num_frames": "default_num_frames",
    "fps": "default_fps",
}


def _diffusion_stage(
    key: str, model: str, declared: Any, names: dict[int, str], engine: dict[str, Any], deploy_stage: Any
) -> dict[str, Any]:
    """A DiT stage (``vllm_omni_diffusion``): fed by its upstream's handoff, built by its declared input processor,
    or alone (the client's requests, mapped by its pipeline class's hooks)."""
    args: dict[str, Any] = {"model": model, "pipeline": key, "stage_id": declared.stage_id}
    parallel = {k: engine[k] for k in DIFFUSION_PARALLEL if k in engine}
    if parallel:
        args["parallel"] = parallel
    if engine.get("cache_backend"):
        args["cache"] = {"backend": engine["cache_backend"], **(engine.get("cache_config") or {})}
    args.update({k: engine[k] for k in DIFFUSION_SETTINGS if k in engine})
    unknown = sorted(
        set(engine) - {*DIFFUSION_SETTINGS, *DIFFUSION_PARALLEL, *LLM_ONLY_SETTINGS, "cache_backend", "cache_config"}
    )
    if unknown:
        raise Refused(
            f"pipeline {key}: cannot be served: stage {declared.stage_id} ({declared.model_stage})'s deploy settings "
            f"{unknown} have no vllm_omni_diffusion field"
        )
    defaults = dict((deploy_stage and deploy_stage.default_sampling_params) or {})
    args.update({field: defaults[name] for name, field in DIFFUSION_DEFAULTS.items() if name in defaults})
    stage: dict[str, Any] = {"name": names[declared.stage_id], "engine": "vllm_omni_diffusion"}
    if declared.input_sources:
        stage["inputs"] = [names[i] for i in declared.input_sources]
    stage["engine_args"] = args
    stage["final_output"] = declared.final_output_type
    return stage


def _async_edge(declared: Any, deploy: Any, consumer: Any) -> Any | None:
    """The producer of ``consumer``'s one input when that edge streams: the deploy config turns async chunks
    on for both and the producer declares an async-chunk processor (vLLM-Omni's rule)."""
    from omni_serve.models.vllm_omni.refusals import async_chunks_on

    if len(consumer.input_sources) != 1:
        return None
    producer = declared.get_stage(consumer.input_sources[0])
    on = async_chunks_on(deploy, producer, consumer)
    return producer if on and producer.async_chunk_process_next_stage_input_func else None


def _streams(declared: Any, deploy: Any, consumer: Any) -> bool:
    """An autoregressive consumer of a streaming edge reads it as a stream, where its streamed prompt is known."""
    from omni_serve.models.vllm_omni import pipelines

    hooks = pipelines.hooks(declared.model_type).stage(consumer.model_stage)
    return (
        _async_edge(declared, deploy, consumer) is not None
        and pipelines.kind(consumer) == "autoregressive"
        and hooks.chunk_prompt is not None
    )


def _chunks(declared: Any, deploy: Any, producer: Any) -> dict[str, Any] | None:
    """The connector settings a producer cuts its chunks with, when its consumer is a generation stage fed one
    chunk a call (where the consumer's left context is cut: by the replica, which needs its frame geometry, or by
    its decoder itself)."""
    from omni_serve.models.vllm_omni import pipelines

    consumers = [s for s in declared.stages if s.input_sources == (producer.stage_id,)]
    if len(consumers) != 1 or _async_edge(declared, deploy, consumers[0]) is None:
        return None
    consumer = consumers[0]
    hooks = pipelines.hooks(declared.model_type).stage(consumer.model_stage)
    if pipelines.kind(consumer) != "generation" or (
        hooks.frame_geometry is None and not hooks.decoder_cuts_left_context
    ):
        return None
    by_id = {s.stage_id: s for s in deploy.stages}
    return _connector_extra(deploy, by_id.get(producer.stage_id))


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


def notes(config: dict[str, Any]) -> list[str]:
    """What a generated graph still needs before it serves (each a header line): a checkpoint to name, or the
    per-model prompt builder a TTS entry stage needs (docs/models.md)."""
    from omni_serve.models.vllm_omni import pipelines

    app = config["applications"][0]
    entry = next(s for s in app["args"]["stages"] if not s.get("inputs"))["engine_args"]
    lines = []
    if entry["model"] == entry["pipeline"]:
        lines.append("# engine_args.model is the pipeline's name here: pass --model ORG/NAME (or edit every stage's).")
    if entry.get("entry") == "speech" and pipelines.hooks(entry["pipeline"]).speech_prompt is None:
        lines.append(
            "# Not served yet: its entry stage takes text to speak in a prompt of the model's own, and omni_serve "
            "has no builder for it (docs/models.md); its stages refuse to start until one is added."
        )
    return lines


def listing() -> list[tuple[str, str]]:
    """Every registered pipeline, then every deploy YAML vLLM-Omni ships, with its graph's stages or why it has none."""
    from omni_serve.models.vllm_omni import pipelines

    rows = []
    for source in [*pipelines.registry(), *(p.name for p in deploy_configs())]:
        try:
            config = generate(source)
        except Refused as err:
            rows.append((source, f"refused: {err}"))
            continue
        stages = config["applications"][0]["args"]["stages"]
        rows.append((source, "graph: " + " -> ".join(s["name"] for s in stages)))
    return rows
