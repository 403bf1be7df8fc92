"""The key ring (omni_serve.api.auth): which client a request's key names, the graph's `api_keys` and `api_key`,
OMNI_SERVE_API_KEY, and a rotation through the ingress's user_config (omni_serve.graph.settings). In process; a
rotation on a running graph, and the jobs it keeps, is tests/test_videos.py."""

from __future__ import annotations

from typing import Any

import pytest

from omni_serve.api.auth import ANONYMOUS, api_key_matches, check_auth, has_key, key_ring
from omni_serve.api.openai.errors import APIError
from omni_serve.graph.config import GraphConfigError, load_graph
from omni_serve.graph.settings import ingress_graph

ARGS: dict[str, Any] = {
    "served_model_name": "m",
    "stages": [
        {"name": "video", "engine": "vllm_omni_diffusion", "engine_args": {"model": "m"}, "final_output": "video"}
    ],
}


def graph(**args: Any) -> Any:
    return load_graph({**ARGS, **args})


def test_a_key_names_its_client_and_a_wrong_one_is_401() -> None:
    ring = key_ring(graph(api_keys={"alice": ["a-old", "a-new"], "bob": "b-1"}, api_key="sk-default"))
    assert ring is not None
    assert [check_auth(f"Bearer {key}", ring) for key in ("a-old", "a-new", "b-1", "sk-default")] == [
        "alice",
        "alice",
        "bob",
        "default",
    ]
    assert check_auth("bearer   a-new ", ring) == "alice"  # the scheme case-insensitive, the token trimmed
    for wrong in (None, "", "Bearer", "Bearer a-ol", "Basic a-old", "a-old", "Bearer a-old-and-more"):
        with pytest.raises(APIError) as refused:
            check_auth(wrong, ring)
        assert refused.value.status == 401
    assert api_key_matches("Bearer b-1", ring) and not api_key_matches("Bearer nope", ring)


def test_no_key_anywhere_is_anonymous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_SERVE_API_KEY", raising=False)
    assert key_ring(graph()) is None and not has_key(graph())
    assert check_auth(None, None) == check_auth("Bearer anything", None) == ANONYMOUS


def test_the_env_key_is_the_default_client_when_the_graph_sets_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_SERVE_API_KEY", "sk-env")
    assert has_key(graph()) and check_auth("Bearer sk-env", key_ring(graph())) == "default"
    keyed = key_ring(graph(api_keys={"alice": "a"}))  # the graph's keys win, as api_key did over the env
    with pytest.raises(APIError):
        check_auth("Bearer sk-env", keyed)


def test_a_rotation_through_user_config_keeps_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_SERVE_API_KEY", raising=False)
    args = graph(api_keys={"alice": "a-old"}).model_dump(mode="json")
    moving = key_ring(ingress_graph(args, {"api_keys": {"alice": ["a-old", "a-new"]}}, None))
    moved = key_ring(ingress_graph(args, {"api_keys": {"alice": "a-new"}}, None))
    assert check_auth("Bearer a-old", moving) == check_auth("Bearer a-new", moving) == "alice"
    assert check_auth("Bearer a-new", moved) == "alice"
    with pytest.raises(APIError):
        check_auth("Bearer a-old", moved)
    # api_key rotated in place is the client 'default' with another key.
    rotated = key_ring(ingress_graph(graph(api_key="k1").model_dump(mode="json"), {"api_key": "k2"}, None))
    assert check_auth("Bearer k2", rotated) == "default"


def test_the_videos_limits_are_a_run_time_setting_merged_key_by_key() -> None:
    args = graph(videos={"max_jobs": 7}).model_dump(mode="json")
    videos = ingress_graph(args, {"videos": {"job_timeout_s": 90, "max_running": 3}}, None).videos
    assert (videos.max_jobs, videos.job_timeout_s, videos.max_running) == (7, 90.0, 3)
    with pytest.raises(GraphConfigError, match="videos.job_timeout_s"):
        ingress_graph(args, {"videos": {"job_timeout_s": 0}}, None)


@pytest.mark.parametrize(
    ("api_keys", "api_key", "says"),
    [
        ({"alice": "k", "bob": ["k"]}, None, "a key of client 'alice' too"),
        ({"alice": ["k1"]}, "k1", "a key of client 'alice' too"),  # api_key is the client 'default''s
        ({"alice": []}, None, "api_keys.alice"),
        ({"alice": [""]}, None, "api_keys.alice"),
        ({"": "k"}, None, "a non-empty client name"),
    ],
    ids=["shared", "shared-with-api-key", "no-keys", "empty-key", "empty-name"],
)
def test_a_ring_that_names_no_one_client_a_key_is_refused(api_keys: Any, api_key: Any, says: str) -> None:
    with pytest.raises(GraphConfigError, match="invalid omni_serve graph") as refused:
        graph(api_keys=api_keys, api_key=api_key)
    assert says in str(refused.value)
