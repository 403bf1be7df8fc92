"""Make PyPI's torchvision==0.28.0 importable on a CPU-only torch, then prove what works and what does not.

PyPI has only the CUDA build of torchvision 0.28.0 (the release pinned to torch==2.13.0). Its ``_C.so`` needs
libtorch_cuda and cannot load over the CPU torch, and ``torchvision/_meta_registrations.py`` then fails at import
with ``operator torchvision::nms does not exist``: two ``register_fake`` decorators are not guarded by
``_has_ops()`` like the rest of the file (pytorch/vision issue #9337). This applies the guard of the open upstream
fix (pytorch/vision PR #9649: register the fakes only when the C ops exist) to exactly the file the wheel shipped
(its RECORD hash), then checks that ``transforms.v2`` and transformers' Qwen2-VL image processor work and that the
C ops fail loudly. Idempotent.

Usage: python .ci/torchvision_cpu.py   (after ``pip install --no-deps torchvision==0.28.0``)
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import pathlib
import subprocess
import sys

# sha256 (RECORD's encoding) of torchvision 0.28.0's _meta_registrations.py as shipped.
SHIPPED = "fFX9uFS7OImZSe36TmjHvWkZDqH-1K5Rv1kyd2Yfy8M"
UNGUARDED = '@torch.library.register_fake("torchvision::{op}")'
GUARDED = '@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda fn: fn))'
OPS = ("nms", "qnms")

CHECK = """
import torch, torchvision.ops
from PIL import Image
from torchvision.transforms import v2
from transformers import Qwen2VLImageProcessor

image = v2.functional.to_image(Image.new("RGB", (40, 30), (200, 10, 10)))
resized = v2.Resize((16, 16))(image)
assert resized.shape == (3, 16, 16) and int(resized[0, 8, 8]) == 200, resized
out = Qwen2VLImageProcessor()(images=[Image.new("RGB", (56, 56))], return_tensors="pt")
assert out["pixel_values"].shape[0] > 0
try:
    torchvision.ops.nms(torch.zeros((1, 4)), torch.zeros(1), 0.5)
except (RuntimeError, ImportError) as err:
    print("torchvision_cpu: transforms ok; C ops unavailable as expected:", str(err).splitlines()[0][:100])
else:
    raise SystemExit("torchvision_cpu: the C ops work: this is not the CUDA wheel the guard was written for")
"""


def apply_guard() -> None:
    spec = importlib.util.find_spec("torchvision")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        sys.exit("torchvision_cpu: torchvision is not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
    text = path.read_text()
    if all(GUARDED.format(op=op) in text for op in OPS):
        print("torchvision_cpu: guard already applied")
        return
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    if digest != SHIPPED:
        sys.exit(f"torchvision_cpu: unexpected {path} (sha256 {digest}); the guard is for torchvision 0.28.0 only")
    for op in OPS:
        if text.count(UNGUARDED.format(op=op)) != 1:
            sys.exit(f"torchvision_cpu: {path}: expected one unguarded register_fake for {op}")
        text = text.replace(UNGUARDED.format(op=op), GUARDED.format(op=op))
    path.write_text(text)
    print("torchvision_cpu: applied the pytorch/vision#9337 guard to", path)


if __name__ == "__main__":
    apply_guard()
    # A fresh interpreter: this one may have cached a failed import.
    subprocess.run([sys.executable, "-c", CHECK], check=True)
