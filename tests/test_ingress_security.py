"""omni_serve.api.hosts' Origin and key rules as the real ingress applies them, in process (no Ray cluster):
its FastAPI app and routes in front of tests/test_routes.py's fake TTS stages.

- a page of another site may not act on any route, JSON or multipart, whatever the route answers otherwise
  (403 ``origin_not_allowed`` before the key or the route is read); the server's own pages and clients that send
  no Origin get the route's answer;
- the list is the graph's ``allowed_origins`` (or ``realtime.allowed_origins``), taken again at each settings change;
- an ingress Serve binds off loopback does not start without a key (its ``reconfigure``, which Serve calls at
  every start) unless ``allow_unauthenticated``, and a change that drops the key is refused; every shipped graph
  bound off loopback says in its header how its key is given (cluster.yaml and deploy/kuberay.yaml give it:
  tests/test_placement.py).

The live check, on the tiny graph Serve runs: tests/test_auth.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from omni_serve.api.hosts import TrustedHosts, TrustedOrigins, is_loopback
from omni_serve.graph.config import GraphConfigError
from tests.fake_routes import GRAPHS, SPEECH, TRANSCRIPTIONS, TTS_GRAPH, VIDEOS, FakeTTS, FakeView

SAME = "http://127.0.0.1"  # the test client's own origin (its Host: 127.0.0.1): the playground's
FOREIGN = "https://evil.example"
SPEAK = {"model": "tiny-tts", "input": "Hello there", "voice": "ryan", "response_format": "wav"}
FORM = {"files": {"file": ("a.wav", b"RIFF0000WAVE", "audio/wav")}, "data": {"model": "tiny-tts"}}


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """The ingress (constructed as Serve does, then its ``reconfigure``) and a client of its app."""
    import ray.serve
    from starlette.testclient import TestClient

    from omni_serve.api import ingress as module

    monkeypatch.setattr(TrustedHosts, "trusted", TrustedHosts.trusted)  # class state: restored after the test
    monkeypatch.setattr(TrustedOrigins, "allowed", TrustedOrigins.allowed)
    context = SimpleNamespace(app_name="tts", servable_object=None)
    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: context)
    user_class = module.Ingress.func_or_class.__mro__[1]  # the class under Serve's ASGI wrapper
    names = user_class.__init__.__globals__  # Serve keeps the class by value: its globals patched there
    monkeypatch.setitem(names, "ServeView", FakeView)
    monkeypatch.setitem(names, "RemoteStages", lambda handles: FakeTTS())
    monkeypatch.setattr(names["playground"], "configure", lambda *args: None)
    monkeypatch.delenv("OMNI_SERVE_API_KEY", raising=False)
    ingress = user_class.__new__(user_class)
    asyncio.run(user_class.__init__(ingress, TTS_GRAPH, {}))
    ingress.reconfigure(None)  # Serve's next call
    context.servable_object = ingress
    with TestClient(module.api, base_url="http://127.0.0.1") as client:
        yield ingress, client


def acts(client: Any, origin: str | None) -> dict[str, int]:
    """The status of a JSON POST, a multipart POST, and a POST and a DELETE the graph has no route for."""
    headers = {} if origin is None else {"origin": origin}
    return {
        "speech": client.post(SPEECH, json=SPEAK, headers=headers).status_code,
        "transcription": client.post(TRANSCRIPTIONS, headers=headers, **FORM).status_code,
        "video": client.post(VIDEOS, json={"prompt": "a cat"}, headers=headers).status_code,
        "delete": client.delete(f"{VIDEOS}/video_1", headers=headers).status_code,
    }


# What the TTS graph answers each (speech; transcriptions: not its route, 400; no video routes: 404).
ANSWERS = {"speech": 200, "transcription": 400, "video": 404, "delete": 404}


def test_a_foreign_page_may_not_act_on_any_route(served: tuple[Any, Any]) -> None:
    _, client = served
    for origin in (FOREIGN, "http://127.0.0.1:9000", "null"):
        assert acts(client, origin) == dict.fromkeys(ANSWERS, 403), origin
    reply = client.post(TRANSCRIPTIONS, headers={"origin": FOREIGN}, **FORM)
    error = reply.json()["error"]
    assert error["code"] == "origin_not_allowed" and "allowed_origins" in error["message"]


def test_the_servers_own_pages_and_clients_without_an_origin_get_the_routes_answers(served: tuple[Any, Any]) -> None:
    _, client = served
    assert acts(client, SAME) == ANSWERS
    assert acts(client, None) == ANSWERS
    assert client.get("/v1/models", headers={"origin": FOREIGN}).status_code == 200  # a read: not concerned


def test_listed_origins_from_the_args_or_a_settings_change(served: tuple[Any, Any]) -> None:
    ingress, client = served
    ingress.reconfigure({"realtime": {"allowed_origins": ["https://app.example"]}})  # in place, the older name
    assert acts(client, "https://app.example") == ANSWERS
    assert acts(client, FOREIGN)["speech"] == 403
    ingress.args = {**TTS_GRAPH, "allowed_origins": [FOREIGN]}
    ingress.reconfigure(None)
    assert acts(client, FOREIGN) == ANSWERS
    assert acts(client, "https://app.example")["speech"] == 403  # the user_config's is gone with it


def bound_to(ingress: Any, host: str) -> None:
    ingress.serve_view = SimpleNamespace(http_options=lambda: SimpleNamespace(host=host, request_timeout_s=60.0))


def test_an_ingress_open_to_the_network_does_not_start_without_a_key(served: tuple[Any, Any]) -> None:
    ingress, client = served
    bound_to(ingress, "0.0.0.0")
    with pytest.raises(GraphConfigError, match="does not start"):
        ingress.reconfigure(None)
    ingress.reconfigure({"api_key": "sk-live"})  # a key in the user_config counts
    assert client.post(SPEECH, json=SPEAK).status_code == 401
    with pytest.raises(GraphConfigError, match="allow_unauthenticated"):
        ingress.reconfigure(None)  # dropping the key is refused: the key stays
    assert client.post(SPEECH, json=SPEAK).status_code == 401
    assert client.post(SPEECH, json=SPEAK, headers={"authorization": "Bearer sk-live"}).status_code == 200
    ingress.args = {**TTS_GRAPH, "allow_unauthenticated": True}
    ingress.reconfigure(None)
    assert client.post(SPEECH, json=SPEAK).status_code == 200


def test_a_key_from_the_environment_counts(served: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    ingress, client = served
    bound_to(ingress, "0.0.0.0")
    monkeypatch.setenv("OMNI_SERVE_API_KEY", "sk-env")
    ingress.reconfigure(None)
    assert client.post(SPEECH, json=SPEAK).status_code == 401
    assert client.post(SPEECH, json=SPEAK, headers={"authorization": "Bearer sk-env"}).status_code == 200


def test_every_shipped_graph_off_loopback_says_how_its_key_is_given() -> None:
    exposed = []
    for path in sorted(GRAPHS.glob("*.yaml")):
        text = path.read_text()
        config = yaml.safe_load(text)
        if is_loopback(config.get("http_options", {}).get("host", "127.0.0.1")):  # Serve's default: 127.0.0.1
            continue
        exposed.append(path.name)
        args = config["applications"][0]["args"]
        header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
        says = all(words in header for words in ("OMNI_SERVE_API_KEY", "api_key", "allow_unauthenticated"))
        assert args.get("api_key") or args.get("allow_unauthenticated") or says, path.name
    assert {"qwen3_omni.yaml", "wan2_2_ti2v.yaml"} <= set(exposed), exposed
