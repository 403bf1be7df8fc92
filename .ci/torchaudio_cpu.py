"""Make PyPI's torchaudio==2.11.0 importable on a CPU-only torch 2.13, then prove what works and what does not.

PyPI's torchaudio 2.11.0 (its newest; there is none for torch 2.13) is a CUDA build. Its package imports
``torchaudio/lib/_torchaudio.abi3.so`` at import time, which needs libc10_cuda and cannot load over the CPU torch,
so ``import torchaudio`` fails. torchaudio loads its extension only when the library file is present
(``torchaudio/_extension/utils.py``, ``_load_lib``: "False if the library file is not found", the path it documents
for deployments without the library), and then runs as its pure-Python part. This removes the three extension
libraries the wheel shipped (checked against the wheel's RECORD hashes, so nothing else is touched), then checks
that what vLLM-Omni calls works on CPU (``functional.melscale_fbanks``, ``functional.resample``,
``transforms.Resample``, ``compliance.kaldi.fbank``) and that an extension-only op (``functional.forced_align``)
fails loudly. Idempotent.

Usage: python .ci/torchaudio_cpu.py [--installed]   (after ``pip install --no-deps torchaudio==2.11.0``;
``--installed``: only say, by the exit code, whether torchaudio 2.11.0 is installed)
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys

VERSION = "2.11.0"
# The CUDA extension libraries of the torchaudio 2.11.0 manylinux_2_28_x86_64 wheel (its RECORD's sha256).
SHIPPED = {
    "_torchaudio.abi3.so": "7oZytPK6m6rhjqm1Ycie_aLqwnkuiT8ZzA7luKeXZqc",
    "libtorchaudio.abi3.so": "06Ww2n38QYT-HRHAn7HW8XirsBu4Vm66yeSrcdvJGOY",
    "torchaudio_prefixctc.abi3.so": "Y_HI0F3SkpeLvUYaTzCGLfMrPB8rhEokFXTpZyF3wI4",
}

CHECK = """
import torch, torchaudio
from torchaudio._extension import _IS_TORCHAUDIO_EXT_AVAILABLE
from torchaudio.compliance import kaldi
from torchaudio.functional import melscale_fbanks, resample
assert not _IS_TORCHAUDIO_EXT_AVAILABLE
fb = melscale_fbanks(513, 0.0, 12000.0, 128, 24000, norm="slaney", mel_scale="slaney")
assert fb.shape == (513, 128) and torch.isfinite(fb).all() and fb.sum() > 0
assert resample(torch.randn(1, 16000), 16000, 24000).shape == (1, 24000)
assert torchaudio.transforms.Resample(24000, 16000)(torch.randn(1, 24000)).shape == (1, 16000)
assert kaldi.fbank(torch.randn(1, 16000), num_mel_bins=80).shape == (98, 80)
try:
    torchaudio.functional.forced_align(torch.zeros(1, 4, 3), torch.zeros(1, 2, dtype=torch.int32))
except Exception as err:
    print("torchaudio_cpu: python functions ok; extension ops unavailable as expected:", str(err).splitlines()[0][:90])
else:
    raise SystemExit("torchaudio_cpu: forced_align works: this is not the wheel the removal was written for")
"""


def record_hash(path: pathlib.Path) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def main() -> None:
    try:
        installed = importlib.metadata.version("torchaudio")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if "--installed" in sys.argv:
        sys.exit(0 if installed == VERSION else 1)
    if installed != VERSION:
        sys.exit(f"torchaudio_cpu: torchaudio {installed} is installed; this is for {VERSION} only")
    spec = importlib.util.find_spec("torchaudio")  # locates the package without importing it
    if spec is None or spec.origin is None:
        sys.exit("torchaudio_cpu: torchaudio is not installed")
    lib = pathlib.Path(spec.origin).parent / "lib"
    for name, digest in SHIPPED.items():
        path = lib / name
        if not path.exists():
            continue
        if record_hash(path) != digest:
            sys.exit(f"torchaudio_cpu: unexpected {path}; the removal is for torchaudio {VERSION}'s wheel only")
        path.unlink()
        print("torchaudio_cpu: removed the CUDA extension library", path)
    unexpected = sorted(p.name for p in lib.glob("*.so"))
    if unexpected:
        sys.exit(f"torchaudio_cpu: extension libraries left in {lib}: {unexpected}")
    subprocess.run([sys.executable, "-c", CHECK], check=True)


if __name__ == "__main__":
    main()
