"""The on-disk cache of locally built checkpoints (the tiny random-weight models).

Several stage replicas (separate processes) may ask for the same checkpoint at once:
builders serialize on a file lock, build into a temporary directory beside the target
and rename it into place, so readers only ever see a complete checkpoint. A marker
file written by the builder carries its build version; another version is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """``cache_dir``, else ``$OMNI_SERVE_CACHE``, else ``~/.cache/omni_serve``."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir)
    return pathlib.Path(os.environ.get("OMNI_SERVE_CACHE", pathlib.Path.home() / ".cache" / "omni_serve"))


def is_current(path: pathlib.Path, marker: str, version: int) -> bool:
    try:
        return json.loads((path / marker).read_text()).get("version") == version
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_checkpoint(
    name: str,
    build: Callable[[pathlib.Path], Any],
    marker: str,
    version: int,
    cache_dir: str | os.PathLike | None = None,
) -> pathlib.Path:
    """Path of checkpoint ``name`` in the cache; ``build(dir)`` makes it (and its marker) on first use."""
    root = cache_root(cache_dir)
    target = root / name
    if is_current(target, marker, version):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{name}.lock"):
        if is_current(target, marker, version):  # another process built it while we waited
            return target
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=root))
        logger.info("building checkpoint %s (version %d) into %s", name, version, target)
        try:
            build(tmp)
            if target.exists():  # stale version: move aside first, rename cannot replace a directory
                stale = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=root))
                os.rename(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
