"""The handoff payload: heavy data one stage hands the next, its wire format, and evidence of where it is loaded.

**Wire format.** Tensors travel as numpy arrays (zero-copy out of the object store on one node).
numpy has no bfloat16 or float8, so those travel as integer words of the same width with their
dtype named in ``meta["dtypes"]``: bf16 stays 2 bytes a value end to end, where widening to
float32 would double every handoff. :func:`arrays` packs, :func:`tensor` unpacks.

**Evidence the ingress never loads a payload.** Every unpickle of a :class:`HandoffPayload` goes
through :func:`load_payload`, which bumps a counter local to the process.

How a payload travels between stages and how long it lives: :mod:`omni_serve.graph.transport`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class HandoffPayload:
    """Heavy data one stage hands to the next (hidden states, codec codes, latents).

    Arrays are numpy (zero-copy through the object store on one node). ``kind`` names
    the format, e.g. ``"qwen3_omni.thinker2talker"``; ``meta`` holds small scalars.
    Unpickling is counted per process (:func:`payload_loads`) so tests can prove the ingress
    never loads one.
    """

    kind: str
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    def __reduce__(self):  # noqa: D105 - see class docstring
        return (load_payload, (self.kind, self.tensors, self.meta))

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays (what it weighs in the object store, near enough)."""
        return sum(array.nbytes for array in self.tensors.values())


def detached(payload: HandoffPayload) -> HandoffPayload:
    """``payload`` with its arrays copied from the object store into this process's memory.

    Arrays resolved from the object store are zero-copy views that pin the stored object as long
    as any of them lives. A stage keeps its input only as this copy and drops the reference, so it
    pins nothing in the store, whatever its frames end up holding. (Engines copy the arrays into
    tensors anyway; :func:`tensor` reuses this copy instead of making a second one.)
    """
    return HandoffPayload(payload.kind, {k: np.array(v, copy=True) for k, v in payload.tensors.items()}, payload.meta)


# --- wire format: tensors as numpy, 16/8-bit floats numpy lacks as words of the same width ----

WORD_DTYPES = {"bfloat16": "int16", "float8_e4m3fn": "int8", "float8_e5m2": "int8"}


def arrays(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """CPU numpy arrays holding the tensors' bytes, and ``{name: dtype}`` for those stored as words.

    Keep the second part in the payload's ``meta["dtypes"]``; :func:`tensor` reads it back.
    """
    out: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, value in tensors.items():
        if isinstance(value, np.ndarray):
            out[name] = value
            continue
        value = value.detach().cpu().contiguous()
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype in WORD_DTYPES:
            import torch

            dtypes[name] = dtype
            value = value.view(getattr(torch, WORD_DTYPES[dtype]))
        out[name] = value.numpy()
    return out, dtypes


def tensor(payload: HandoffPayload, name: str, device: Any = None) -> torch.Tensor:
    """``payload.tensors[name]`` as a torch tensor of its original dtype, on ``device``.

    Writable arrays are shared with the tensor; read-only ones (object store memory, which torch
    must not wrap) are copied.
    """
    import torch

    array = payload.tensors[name]
    value = torch.from_numpy(array if array.flags.writeable else array.copy())
    dtype = payload.meta.get("dtypes", {}).get(name)
    if dtype is not None:
        value = value.view(getattr(torch, dtype))
    return value if device is None else value.to(device)


def padded(payload: HandoffPayload, nbytes: int) -> HandoffPayload:
    """Test-only: ``payload`` with an extra ``nbytes`` tensor no engine reads (production-sized handoffs on CPU)."""
    if nbytes > 0:
        payload.tensors["padding"] = np.zeros(nbytes, dtype=np.uint8)
    return payload


# --- evidence: how often this process unpickled a payload -------------------------------------

_loads: Counter[str] = Counter()


def load_payload(kind: str, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> HandoffPayload:
    _loads[kind] += 1
    return HandoffPayload(kind=kind, tensors=tensors, meta=meta)


def payload_loads() -> dict[str, int]:
    """How many payloads of each kind this process has deserialized."""
    return dict(_loads)
