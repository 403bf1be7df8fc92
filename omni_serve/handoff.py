"""Handoff payloads and the per-process count of how often one was deserialized.

The count is the evidence for the invariant "the ingress routes references and
never loads a payload": every unpickle of a :class:`HandoffPayload` goes through
:func:`load_payload`, which bumps a counter local to the process.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from omni_serve.types import HandoffPayload

_loads: Counter[str] = Counter()


def load_payload(kind: str, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> HandoffPayload:
    _loads[kind] += 1
    return HandoffPayload(kind=kind, tensors=tensors, meta=meta)


def payload_loads() -> dict[str, int]:
    """How many payloads of each kind this process has deserialized."""
    return dict(_loads)
