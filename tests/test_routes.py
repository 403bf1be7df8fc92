"""What a graph answers follows from its final outputs and its entry stage: a TTS graph ``/v1/audio/speech``,
a speech-to-speech graph chat, realtime, transcriptions and speech, an image graph images and chat (an image
part); a route it cannot answer is a 400 naming why, and ``/v1/models`` lists the routes it answers.

The ingress runs in process here (its FastAPI app, the real routes, orchestrator and transport contract)
in front of a small fake TTS engine, so no Ray cluster starts: the graph-level selection for every graph
omni_serve ships is in :func:`test_shipped_graphs_answer_by_their_outputs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import wave
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import yaml

from omni_serve.graph.config import GraphConfig, load_graph
from tests.fake_routes import (
    CHAT,
    EDITS,
    GRAPHS,
    IMAGES,
    REALTIME,
    SPEECH,
    TRANSCRIPTIONS,
    TTS_GRAPH,
    VIDEOS,
    VOICES,
    FakeTTS,
    FakeView,
)


def answered(graph: GraphConfig) -> set[str]:
    return {route for route, why in graph.routes().items() if why is None}


def test_shipped_graphs_answer_by_their_outputs() -> None:
    def shipped(name: str) -> GraphConfig:
        return load_graph(yaml.safe_load((GRAPHS / name).read_text())["applications"][0]["args"])

    speech_to_speech = {CHAT, SPEECH, VOICES, REALTIME, TRANSCRIPTIONS}
    for name in ("tiny_omni.yaml", "tiny_omni_vllm.yaml", "qwen3_omni.yaml", "qwen2_5_omni.yaml"):
        assert answered(shipped(name)) == speech_to_speech, name
    assert answered(shipped("single_stage_llm.yaml")) == {CHAT}
    assert answered(shipped("tiny_image.yaml")) == {CHAT, IMAGES}  # chat: the image as an image_url part
    assert shipped("tiny_image.yaml").routes()[EDITS] == "its entry stage takes no images"
    assert answered(shipped("tiny_image_edit_vllm_omni.yaml")) == {CHAT, IMAGES, EDITS}
    assert answered(shipped("tiny_video.yaml")) == {VIDEOS}
    tts = load_graph(TTS_GRAPH)
    assert tts.entry_prompt == "speech" and answered(tts) == {SPEECH, VOICES}
    assert "takes text to speak, not a conversation" in tts.routes()[CHAT]
    assert tts.routes()[IMAGES] == "it generates no images"


@contextlib.contextmanager
def in_process_api(monkeypatch: pytest.MonkeyPatch, graph: dict[str, Any]) -> Iterator[tuple[Any, FakeTTS]]:
    """The ingress's real FastAPI app and routes in process for ``graph``, its stages the fake TTS engine."""
    import ray.serve
    from starlette.testclient import TestClient

    from omni_serve.api import ingress as module

    stages = FakeTTS()
    context = SimpleNamespace(app_name="tts", servable_object=None)
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: context)
    user_class = module.Ingress.func_or_class.__mro__[1]  # the class under Serve's ASGI wrapper
    # Serve keeps the class by value (its own copy of the module's globals): patched there.
    names = user_class.__init__.__globals__
    monkeypatch.setitem(names, "ServeView", FakeView)
    monkeypatch.setitem(names, "RemoteStages", lambda handles: stages)
    monkeypatch.setattr(names["playground"], "configure", lambda *args: None)
    ingress = user_class.__new__(user_class)
    asyncio.run(user_class.__init__(ingress, graph, {}))
    context.servable_object = ingress
    with TestClient(module.api, base_url="http://127.0.0.1") as client:  # a Host the loopback server accepts
        yield client, stages


@pytest.fixture
def tts_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, FakeTTS]]:
    with in_process_api(monkeypatch, TTS_GRAPH) as api:
        yield api


def test_a_tts_graph_speaks_and_refuses_chat_naming_why(tts_api: tuple[Any, FakeTTS]) -> None:
    client, stages = tts_api
    card = client.get("/v1/models").json()["data"][0]
    assert card["routes"] == [SPEECH, VOICES] and card["voices"] == ["ryan", "vivian"]

    reply = client.post(
        SPEECH, json={"model": "tiny-tts", "input": "Hello there", "voice": "Ryan", "response_format": "wav"}
    )
    assert reply.status_code == 200, reply.text
    with wave.open(io.BytesIO(reply.content)) as wav:  # streamed: the header leaves the length open
        samples = np.frombuffer(wav.readframes(1 << 20), np.int16)
        assert wav.getframerate() == 24000 and wav.getsampwidth() == 2
    assert len(samples) == 2 * 240 * 5  # two chunks of 5 codec ids: 2 x 1200 samples
    (talker,) = [c for c in stages.calls if c.text_to_speak is not None]
    assert talker.text_to_speak == "Hello there" and talker.request_id.endswith("/qwen3_tts")

    for route, body in ((CHAT, {"messages": [{"role": "user", "content": "hi"}]}),):
        refused = client.post(route, json={"model": "tiny-tts", **body})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "model" and error["code"] == "unsupported_route"
        assert "does not answer /v1/chat/completions: its entry stage takes text to speak" in error["message"]
    refused = client.post(IMAGES, json={"model": "tiny-tts", "prompt": "a cat"})
    assert refused.status_code == 400 and "it generates no images" in refused.json()["error"]["message"]
    refused = client.post(VIDEOS, json={"model": "tiny-tts", "prompt": "a cat"})
    assert refused.status_code == 404  # the video routes exist only where videos do
    with client.websocket_connect(f"ws://127.0.0.1{REALTIME}") as session:  # accepted: it reads why, then the close
        error = session.receive_json()["error"]
        assert error["code"] == "unsupported_route" and "does not answer /v1/realtime" in error["message"]
        assert session.receive()["code"] == 1008
    assert len(stages.calls) == 3  # the refused requests ran no stage


def test_a_route_the_model_refuses_is_a_400_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """``refused_routes`` (a pipeline's declared endpoint restrictions, which generated graphs carry): the route its
    outputs would answer is refused with the model's reason and left off the card; a route omni_serve does not
    serve is a config error naming the field."""
    from omni_serve.graph.config import GraphConfigError

    why = "Speech only. Use /v1/audio/speech."
    graph = {**TTS_GRAPH, "refused_routes": {VOICES: why}}
    with in_process_api(monkeypatch, graph) as (client, stages):
        assert client.get("/v1/models").json()["data"][0]["routes"] == [SPEECH]
        refused = client.get(VOICES)
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["code"] == "unsupported_route", refused.text
        assert error["message"].endswith(f"does not answer {VOICES}: {why}") and not stages.calls
    with pytest.raises(GraphConfigError, match="refused_routes"):
        load_graph({**TTS_GRAPH, "refused_routes": {"/v1/completions": why}})
