"""The wall time of one real-size Qwen3-Omni code2wav decode call, per chunk length and batch.

Grounds the paced model's code2wav step (docs/benchmarks.md, "The paced model"): transformers'
``Qwen3OmniMoeCode2Wav`` built from its default config (the released model's vocoder shape: 16
quantizers, 2048 codes, 1920 samples a frame) with random weights, so it needs no model hub. The
weights' values do not change the work of a convolutional decoder, only its output.

    python benchmarks/code2wav_cost.py --device cuda   # bfloat16; --device cpu runs float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--frames", type=int, nargs="+", default=[1, 8, 26, 50, 64, 256])
    parser.add_argument("--batches", type=int, nargs="*", default=[4, 8], help="batch sizes tried at 50 frames")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    config = Qwen3OmniMoeCode2WavConfig()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    model = Qwen3OmniMoeCode2Wav._from_config(config, dtype=dtype).to(args.device).eval()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"code2wav: {params:.0f} M parameters, {dtype}, {args.device}; {model.total_upsample} samples a frame")

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(frames: int, batch: int) -> None:
        codes = torch.randint(0, config.codebook_size, (batch, config.num_quantizers, frames), device=args.device)
        seconds = []
        with torch.inference_mode():
            for _ in range(5):  # warm-up: kernels chosen, allocator filled
                model(codes)
            sync()
            for _ in range(args.repeats):
                start = time.perf_counter()
                model(codes)
                sync()
                seconds.append(time.perf_counter() - start)
        seconds.sort()
        median, p90 = statistics.median(seconds) * 1e3, seconds[int(len(seconds) * 0.9)] * 1e3
        print(f"frames={frames:4d} batch={batch}: median {median:7.2f} ms, p90 {p90:7.2f} ms")

    for frames in args.frames:
        timed(frames, 1)
    for batch in args.batches:
        timed(50, batch)


if __name__ == "__main__":
    main()
