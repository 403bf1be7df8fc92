"""Realtime voice sessions: K concurrent ``/v1/realtime`` sessions, each speaking T turns.

    python benchmarks/realtime.py --start-tiny --url http://127.0.0.1:8011 --sessions 1 4 16 --turns 3

Each session streams real speech (espeak-ng, 24 kHz pcm16) at wall-clock pace in 100 ms appends,
then silence, and the server VAD (Silero) ends the turn. Per turn:

- voice-to-voice latency: the client's end of speech (its last speech byte sent) -> the first
  ``response.output_audio.delta``; it includes the VAD's ``silence_duration_ms`` (--silence-ms), as a
  voice agent's does;
- barge-in latency (the last turn of each session, --barge-in): the session speaks again once the
  reply's first audio arrived; from the start of that speech to the last audio delta of the cancelled
  response (what the client would still have to drop; 0 when none came after the speech began), and
  ``cancelled``: from the start of that speech to the cancelled response's ``response.done``.

``--pacings paced`` deploys the graph with each stage's engine steps paced like an accelerator
(bench.py's ``H100_PACE``), ``unpaced`` runs the engines as fast as the shared cores allow.
Writes JSON (--out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench import H100_PACE, _graph_edit, _replica_counts, report  # noqa: E402
from tests.audio import spoken  # noqa: E402

RATE = 24000
CHUNK = RATE * 2 // 10  # 100 ms


@dataclass
class Session:
    voice_to_voice: list[float] = field(default_factory=list)
    barge_in: list[float] = field(default_factory=list)
    cancelled_in: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def _stream(ws: Any, audio: bytes) -> None:
    """``audio`` in 100 ms appends at wall-clock pace (a microphone's)."""
    start = time.monotonic()
    for i, offset in enumerate(range(0, len(audio), CHUNK)):
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(audio[offset : offset + CHUNK])}))
        await asyncio.sleep(max(0.0, start + (i + 1) * 0.1 - time.monotonic()))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def one_session(args: argparse.Namespace, speech: bytes, seed: int) -> Session:
    import websockets

    out = Session()
    url = f"{args.url.replace('http', 'ws', 1)}/v1/realtime?model={args.model}"
    silence = bytes(RATE * 2 * (args.silence_ms + 600) // 1000)
    async with websockets.connect(url, max_size=None) as ws:
        turn = {"type": "server_vad", "silence_duration_ms": args.silence_ms}
        update = {"audio": {"input": {"turn_detection": turn}}, "max_output_tokens": args.max_tokens}
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        for t in range(args.turns):
            barge = args.barge_in and t == args.turns - 1
            sender = asyncio.create_task(_stream(ws, speech + silence))
            speech_end = time.monotonic() + len(speech) / (2 * RATE)
            if barge:  # a long reply (the greedy tiny talker does not stop by itself), to be interrupted
                params = {"stage_sampling": {"talker": {"temperature": 0.0, "max_tokens": 4000}}}
                update = {"audio": {"input": {"turn_detection": {**turn, "create_response": False}}}}
                await ws.send(json.dumps({"type": "session.update", "session": update}))
            first_audio = last_audio = None
            barge_start: float | None = None
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), args.timeout))
                kind = event["type"]
                if kind == "error":
                    out.errors.append(event["error"]["message"])
                elif kind == "input_audio_buffer.committed" and barge and barge_start is None:
                    await ws.send(json.dumps({"type": "response.create", "response": params}))
                elif kind == "response.output_audio.delta":
                    last_audio = time.monotonic()
                    if first_audio is None:
                        first_audio = last_audio
                        out.voice_to_voice.append(first_audio - speech_end)
                        if barge and barge_start is None:  # speak over the reply now
                            sender.cancel()
                            barge_start = time.monotonic()
                            sender = asyncio.create_task(_stream(ws, speech + silence))
                elif kind == "response.done":
                    status = event["response"]["status"]
                    if status == "failed":
                        out.errors.append(str(event["response"]["status_details"]))
                    if barge_start is not None and status == "cancelled" and last_audio is not None:
                        # 0: no audio of the reply arrived after the interrupting speech began.
                        out.barge_in.append(max(0.0, last_audio - barge_start))
                        out.cancelled_in.append(time.monotonic() - barge_start)
                    break
            await asyncio.gather(sender, return_exceptions=True)
        if args.barge_in:  # the interrupting turn is left unanswered (create_response off)
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    return out


async def run_sessions(args: argparse.Namespace, k: int, speech: bytes) -> list[Session]:
    results = await asyncio.gather(*(one_session(args, speech, s) for s in range(k)), return_exceptions=True)
    return [r if isinstance(r, Session) else Session(errors=[repr(r)]) for r in results]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


def summary(label: str, k: int, sessions: list[Session]) -> dict[str, Any]:
    v2v = [x for s in sessions for x in s.voice_to_voice]
    barge = [x for s in sessions for x in s.barge_in]
    cancelled = [x for s in sessions for x in s.cancelled_in]
    return {
        "name": label,
        "sessions": k,
        "turns": len(v2v),
        "v2v_p50": pct(v2v, 50),
        "v2v_p99": pct(v2v, 99),
        "barge_in_p50": pct(barge, 50),
        "barge_in_p99": pct(barge, 99),
        "cancelled_p50": pct(cancelled, 50),
        "cancelled_p99": pct(cancelled, 99),
        "errors": sum(len(s.errors) for s in sessions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--start-tiny", action="store_true", help="start Ray and deploy graphs/tiny_omni.yaml")
    parser.add_argument("--model", default="tiny-qwen3-omni")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--barge-in", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--silence-ms", type=int, default=500, help="the VAD's silence_duration_ms")
    parser.add_argument("--max-tokens", type=int, default=16, help="thinker tokens per reply")
    parser.add_argument("--pacings", nargs="+", default=["paced", "unpaced"], choices=["paced", "unpaced"])
    parser.add_argument("--replicas", type=_replica_counts, default={"thinker": 1, "talker": 1, "code2wav": 1})
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default="benchmarks/realtime.json")
    args = parser.parse_args()
    speech = spoken("Hello, can you tell me what the weather is like today?")
    rows: list[dict[str, Any]] = []
    pacings = args.pacings if args.start_tiny else ["as deployed"]
    if args.start_tiny:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="serve", log_to_driver=False)
    try:
        for pacing in pacings:
            if args.start_tiny:
                import ray

                from omni_serve.cli.launch import deploy_graph_file, wait_healthy

                pace = H100_PACE if pacing == "paced" else None
                port = int(args.url.rsplit(":", 1)[1])
                edit = _graph_edit(args.replicas, None, pace)
                deploy_graph_file("tiny_omni.yaml", ray.get_runtime_context().gcs_address, port, edit)
                wait_healthy(args.url, replaced=True)  # the paced graph replaces the unpaced one
            for k in args.sessions:
                sessions = asyncio.run(run_sessions(args, k, speech))
                row = summary(pacing, k, sessions)
                for error in sorted({e for s in sessions for e in s.errors})[:3]:
                    print(f"  error: {error[:300]}", flush=True)
                rows.append(row)
                print(row, flush=True)
    finally:
        if args.start_tiny:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    report(args, rows, cols=list(rows[0]) if rows else None)


if __name__ == "__main__":
    main()
