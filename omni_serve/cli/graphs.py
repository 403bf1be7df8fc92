"""Graph files generated from vLLM-Omni's own pipeline declarations and deploy configs, for any pipeline.

    python -m omni_serve.cli.graphs from-vllm-omni qwen3_omni_moe -o graphs/qwen3_omni.yaml
    python -m omni_serve.cli.graphs from-vllm-omni path/to/deploy.yaml --pipeline qwen3_omni_moe --model ORG/NAME
    python -m omni_serve.cli.graphs list        # every registered pipeline: its graph, or why it has none

The command line of :mod:`omni_serve.graph.generator` (what a graph is made of, and what changes on the way from
vLLM-Omni's deploy config): its arguments, the comment header written above each graph, exit codes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from omni_serve.api.hosts import is_loopback
from omni_serve.graph.generator import Refused, generate, gpus_needed, listing, notes, resolve_source

# Off loopback, the ingress starts only with an API key (omni_serve.api.hosts.check_exposure): the header says how.
KEY_HEADER = (
    "# Serve listens on every interface (0.0.0.0): the ingress starts only with an API key, which clients send as",
    "# 'Authorization: Bearer KEY'. Give it OMNI_SERVE_API_KEY where Ray starts (`OMNI_SERVE_API_KEY=KEY serve run",
    "# ...` on a new cluster, `ray start` on each node) or in the ingress's runtime_env env_vars, or args.api_key;",
    "# args.allow_unauthenticated: true serves it open on purpose (docs/api.md, Security).",
)


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


def header(config: dict[str, Any], command: str, deploy_path: Path | None, output: str | None) -> str:
    """The comments written above a generated graph: the command and sources it came from, its GPUs, what it
    still needs (generator.notes), the API key off loopback and how to run it."""
    import vllm_omni

    app = config["applications"][0]
    deploy = f"deploy config {deploy_path.parent.name}/{deploy_path.name}" if deploy_path else "vLLM-Omni's defaults"
    lines = [
        f"# {app['args']['served_model_name']} on vLLM-Omni {getattr(vllm_omni, '__version__', '?')} stage engines,",
        "# one Ray Serve deployment per stage. Generated, then only these comments edited:",
        f"#   {command}",
        f"# from vLLM-Omni's pipeline declaration + {deploy}.",
        "# GPUs (one replica per stage): "
        + ", ".join(
            f"{d['name']} {d['ray_actor_options']['num_gpus']}" for d in app["deployments"] if d["name"] != "ingress"
        )
        + f" -> {gpus_needed(config)} GPU(s).",
        "# Stages with fractional num_gpus share a GPU as in the deploy config; each one's vLLM",
        "# gpu_memory_utilization equals its fraction. Needs: pip install 'omni_serve[vllm]' on the nodes.",
        *notes(config),
        *(() if is_loopback(config["http_options"]["host"]) else KEY_HEADER),
        *(_placement_header(app, output) or [f"#   serve run {output or 'THIS_FILE.yaml'}"]),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_serve.cli.graphs", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("from-vllm-omni", help="write a graph from a vLLM-Omni pipeline / deploy config")
    gen.add_argument("source", help="pipeline (its registry key: qwen3_omni_moe), reference model id, or deploy YAML")
    gen.add_argument("-o", "--output", help="graph file to write (default: stdout)")
    gen.add_argument("--model", help="HF model id or local path served (default: the pipeline's reference model)")
    gen.add_argument("--pipeline", help="vLLM-Omni pipeline, when a deploy YAML does not name it")
    gen.add_argument("--platform", default="cuda", help="platform section of the deploy config to apply")
    sub.add_parser("list", help="every registered vLLM-Omni pipeline: its graph's stages, or why it has none")
    args = parser.parse_args(argv)
    try:
        return _command(args, argv)
    except ModuleNotFoundError as err:
        # `make serve` installs no vLLM-Omni: say how to get it, not a traceback (other missing modules are bugs).
        if (err.name or "").split(".")[0] not in ("vllm_omni", "vllm"):
            raise
        sys.stderr.write(
            f"omni_serve.cli.graphs: reads vLLM-Omni's declarations, and {sys.executable} has no module named "
            f"'{err.name}': `make install-vllm-omni PYTHON={sys.executable}` installs it (CPU; on GPU nodes: "
            "pip install 'omni_serve[vllm]')\n"
        )
        return 2


def _command(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The parsed command run: a listing, or a graph written (a refused pipeline: 2, its reason on stderr)."""
    if args.command == "list":
        for key, what in listing():
            sys.stdout.write(f"{key}: {what}\n")
        return 0
    try:
        config = generate(args.source, model=args.model, pipeline=args.pipeline, platform=args.platform)
        _, deploy_path = resolve_source(args.source, args.pipeline)
    except Refused as err:
        sys.stderr.write(f"{err}\n")
        return 2
    command = "python -m omni_serve.cli.graphs " + " ".join(argv if argv is not None else sys.argv[1:])
    text = header(config, command, deploy_path, args.output) + yaml.safe_dump(config, sort_keys=False, width=120)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
