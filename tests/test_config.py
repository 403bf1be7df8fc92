"""Graph validation: every bad graph fails with one message that names the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from omni_serve.graph.config import DEADLINE_MARGIN_S, GraphConfigError, check_timeouts, load_graph
from omni_serve.types import Modality
from tests.tiny_config import (
    GRAPHS,
    tiny_args,
)


def error_of(args: dict) -> str:
    with pytest.raises(GraphConfigError) as info:
        load_graph(args)
    return str(info.value)


def test_tiny_graph_validates() -> None:
    graph = load_graph(tiny_args())
    assert [s.name for s in graph.stages] == ["thinker", "talker", "code2wav"]
    assert graph.entry.name == "thinker"
    assert graph.modalities == {Modality.TEXT, Modality.AUDIO}


@pytest.mark.parametrize("path", sorted(GRAPHS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_graph_validates(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    for app in config["applications"]:
        graph = load_graph(app["args"])
        deployments = {d["name"] for d in app.get("deployments", [])}
        # Resources and autoscaling of every stage are set in the file, where Ray users look (the
        # ingress's entry, where the engine runs in the ingress), and no entry names a deployment
        # the graph does not have (Serve refuses the file).
        assert {graph.deployment(s.name) for s in graph.stages} <= deployments, path.name
        assert deployments <= {"ingress", *(graph.deployment(s.name) for s in graph.stages)}, path.name


def test_unknown_upstream_stage() -> None:
    args = tiny_args()
    args["stages"][1]["inputs"] = ["thinkr"]
    message = error_of(args)
    assert "stages[1].inputs" in message and "unknown upstream stage 'thinkr'" in message


def test_cycle() -> None:
    args = tiny_args()
    args["stages"][0]["inputs"] = ["code2wav"]
    message = error_of(args)
    assert "cycle" in message and "stages[" in message


def test_input_was_renamed_inputs() -> None:
    args = tiny_args()
    args["stages"][1].pop("inputs")
    args["stages"][1]["input"] = "thinker"
    assert "stages[1]: input: renamed inputs, a list" in error_of(args)


def test_fan_in_stage_reads_several_upstream_stages() -> None:
    """A stage with several inputs (vLLM-Omni's several input_sources) joins its branches; it runs for any
    modality it leads to with all of its upstream stages, and it cannot stream one of them."""
    args = tiny_args()
    thinker, talker, code2wav = args["stages"]
    args["stages"] = [
        thinker,
        {**talker, "name": "left", "inputs": ["thinker"]},
        {**talker, "name": "right", "inputs": ["thinker"]},
        {**code2wav, "inputs": ["left", "right"]},
    ]
    graph = load_graph(args)
    assert [c.name for c in graph.children("left")] == ["code2wav"]
    assert graph.stages_for({Modality.AUDIO}) == {"thinker", "left", "right", "code2wav"}
    args["stages"][3]["stream_input"] = True
    assert "stages[3].stream_input: a stage streams the input of exactly one upstream stage" in error_of(args)
    args["stages"][3].update(stream_input=False, inputs=["left", "left"])
    assert "stages[3].inputs: an upstream stage named twice" in error_of(args)


def test_no_final_output() -> None:
    args = tiny_args()
    for stage in args["stages"]:
        stage.pop("final_output", None)
    assert "no stage has a final_output" in error_of(args)


def test_unknown_engine() -> None:
    args = tiny_args()
    args["stages"][2]["engine"] = "onnx"
    message = error_of(args)
    assert "stages[2].engine" in message and "transformers" in message


def test_bad_engine_args_name_the_field() -> None:
    args = tiny_args()
    args["stages"][0]["engine_args"]["model_stage"] = "narrator"
    assert "stages[0].engine_args" in error_of(args)


def test_bad_sampling_default() -> None:
    args = tiny_args()
    args["stages"][0]["default_sampling"]["temperature"] = -1
    assert "stages[0].default_sampling.temperature" in error_of(args)


def test_sampling_default_the_engine_cannot_honour() -> None:
    args = tiny_args()
    args["stages"][0]["default_sampling"]["ignore_eos"] = True  # the transformers thinker honours it
    load_graph(args)
    args["stages"][1]["default_sampling"]["min_p"] = 0.1  # the transformers talker does not
    assert "stages[1].default_sampling.min_p: the transformers engine of stage 'talker' cannot honour" in error_of(args)


def test_duplicate_and_reserved_names() -> None:
    args = tiny_args()
    args["stages"].append(copy.deepcopy(args["stages"][2]))
    assert "duplicate stage name 'code2wav'" in error_of(args)
    args = tiny_args()
    args["stages"][0]["name"] = "ingress"
    assert "stages[0].name" in error_of(args)


def test_engine_in_ingress_takes_one_stage() -> None:
    args = tiny_args()
    args["engine_in_ingress"] = True
    message = error_of(args)
    assert "engine_in_ingress" in message and "has 3" in message
    args["stages"] = args["stages"][:1]
    args["stages"][0]["final_output"] = "text"
    graph = load_graph(args)
    assert graph.deployment("thinker") == "ingress"
    assert load_graph(tiny_args()).deployment("thinker") == "thinker"


def test_unknown_key_is_rejected() -> None:
    args = tiny_args()
    args["stages"][0]["upstream"] = ["x"]
    assert "stages[0].upstream" in error_of(args)


def test_stages_for_modalities() -> None:
    graph = load_graph(tiny_args())
    assert graph.stages_for({Modality.TEXT}) == {"thinker"}
    assert graph.stages_for({Modality.TEXT, Modality.AUDIO}) == {"thinker", "talker", "code2wav"}


@pytest.mark.parametrize("path", sorted(GRAPHS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_graph_times_out_before_serve_does(path: Path) -> None:
    """A silent stage must reach the client as the API's 504, before Serve's plain-text 408."""
    config = yaml.safe_load(path.read_text())
    request_timeout_s = config["http_options"]["request_timeout_s"]
    for app in config["applications"]:
        check_timeouts(load_graph(app["args"]).stage_timeout_s, request_timeout_s)


def test_stage_timeout_must_leave_room_below_serves_timeout() -> None:
    check_timeouts(118, 120)
    check_timeouts(10_000, None)  # Serve without a request timeout
    with pytest.raises(GraphConfigError, match=r"stage_timeout_s \(120 s\).*request_timeout_s \(120 s\)"):
        check_timeouts(120, 120)
    with pytest.raises(GraphConfigError):
        check_timeouts(120 - DEADLINE_MARGIN_S + 0.5, 120)


def test_voice_aliases_are_case_insensitive() -> None:
    args = tiny_args()
    args["voice_aliases"] = {"Alloy": "Chelsie"}
    assert load_graph(args).voice_aliases == {"alloy": "chelsie"}


# --- what a chat message may carry: the entry stage's input modalities ------------------------


def graph_args(name: str) -> dict:
    return yaml.safe_load((GRAPHS / name).read_text())["applications"][0]["args"]


@pytest.mark.parametrize(
    ("name", "takes"),
    [
        ("tiny_omni.yaml", ["text", "audio", "image", "video"]),
        ("tiny_omni_vllm.yaml", ["text", "audio", "image", "video"]),
        ("qwen3_omni.yaml", ["text", "audio", "image", "video"]),
        ("single_stage_llm.yaml", ["text"]),  # the vllm family: text only (no VLM path yet)
    ],
)
def test_input_modalities_are_the_entry_stages(name: str, takes: list[str]) -> None:
    assert [m.value for m in load_graph(graph_args(name)).input_modalities] == takes


def test_a_graph_refuses_media_its_entry_stage_cannot_take_naming_the_part() -> None:
    from omni_serve.api.openai.chat import ChatCompletionRequest
    from omni_serve.api.openai.errors import APIError
    from omni_serve.api.openai.messages import MediaRules

    graph = load_graph(graph_args("single_stage_llm.yaml"))
    rules = MediaRules(frozenset(m.value for m in graph.input_modalities), graph.media_policy, graph.media_input)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]},
            ],
        }
    )
    with pytest.raises(APIError) as info:
        request.chat_messages(rules)
    assert info.value.status == 400 and info.value.param == "messages.1.content.1"
    assert "'image_url' input is not supported by this graph (it takes text)" in info.value.message


def test_media_args_are_validated_naming_the_field() -> None:
    args = tiny_args()
    args["media_policy"] = {"allowed_addresses": ["not-an-ip"]}
    assert "media_policy.allowed_addresses" in error_of(args) and "not-an-ip" in error_of(args)
    args = tiny_args()
    args["media_policy"] = {"allowed_local_dir": "relative/dir"}
    assert "media_policy.allowed_local_dir" in error_of(args)
    args = tiny_args()
    args["media_input"] = {"max_video_frames": 0}
    assert "media_input.max_video_frames" in error_of(args)
    args = tiny_args()
    args["media_input"] = {"max_pixels": 1}  # unknown key
    assert "media_input.max_pixels" in error_of(args)
