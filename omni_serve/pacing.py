"""Step pacing: a minimum time per engine step (engine arg ``min_step_s``), one option for every engine family.

On a CPU test machine every stage shares the same cores, so stage timings interfere in ways they
would not on hardware where each stage owns an accelerator. A stage with ``min_step_s`` set takes
at least that long per engine step: it *waits* out the rest of the step, holding no core, so a
benchmark can model a stage whose step time is set by its own device, and tests can keep requests
in flight for certain. 0 (every shipped graph) turns it off.

What one step is, per family (each paces with :class:`StepPacer`; the field is :func:`min_step_field`):

- ``transformers``: one decoding step of one request (its HF stopping criteria); code2wav one chunk decode;
- ``diffusers``: one denoising step (the pipeline's step-end callback);
- ``vllm`` and ``vllm_omni``: one engine step, i.e. one model-runner execution for the whole batch
  (:mod:`omni_serve.platforms.paced`, inside the engine's worker): 8 requests decoding together
  take one paced step, as on a GPU;
- ``vllm_omni_diffusion``: one denoising step as the engine schedules it with ``step_execution``
  (:mod:`omni_serve.platforms.paced`, inside its model runner).

The vLLM and vLLM-Omni engines run their steps in other processes (the EngineCore, the workers):
their engine args carry the value to them in the engine config's ``additional_config`` under
:data:`ENGINE_CONFIG_KEY` (:func:`engine_config` / :func:`configured_min_step`).

An abort ends the wait at once where the pacer belongs to one request (transformers, diffusers).
Where a step serves a whole batch (the vLLM families) the step runs out, and the engine drops the
aborted request when it ends, as vLLM does on a GPU: a request's abort never waits more than one step.

The pacer runs on the thread that runs the engine's steps (it blocks that thread, never an event loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from pydantic import Field

# The key of the step minimum in a vLLM / vLLM-Omni engine config's ``additional_config``.
ENGINE_CONFIG_KEY = "omni_serve_min_step_s"


def min_step_field(default: float | None = 0.0) -> Any:
    """The ``min_step_s`` field of every engine family's ``EngineArgs`` (and of a stage's run-time settings,
    where None keeps the engine's)."""
    return Field(
        default,
        ge=0.0,
        le=10.0,
        description="Minimum seconds per engine step (a decoding step of the batch; code2wav: a chunk decode; "
        "diffusion: a denoising step), waited without using a core: models a stage that owns its accelerator "
        "(benchmarks) or holds requests in flight (tests). 0 = off, as in every shipped graph.",
    )


def engine_config(min_step_s: float, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An engine's ``additional_config``: ``given`` plus the step minimum (left out when 0)."""
    config = dict(given or {})
    if min_step_s:
        config[ENGINE_CONFIG_KEY] = min_step_s
    return config


def configured_min_step(additional_config: Any) -> float:
    """The step minimum an engine config's ``additional_config`` carries (0 when none)."""
    if isinstance(additional_config, Mapping):
        return float(additional_config.get(ENGINE_CONFIG_KEY, 0.0))
    return 0.0


class StepPacer:
    """Call :meth:`step_done` at the end of each engine step.

    A step begins when the previous one ended (steps back to back, as a request's decoding loop runs
    them) or at :meth:`step_started` (an engine that idles between steps).
    """

    def __init__(self, min_step_s: float, cancelled: threading.Event | None = None):
        self.min_step_s = min_step_s
        self.cancelled = cancelled if cancelled is not None else threading.Event()  # never set: no abort cuts it
        self._step_started = time.monotonic()

    def step_started(self) -> None:
        """A step begins now."""
        self._step_started = time.monotonic()

    def step_done(self) -> None:
        """Wait until ``min_step_s`` has passed since the step began (at once when aborted); start the next."""
        if self.min_step_s:
            left = self.min_step_s - (time.monotonic() - self._step_started)
            if left > 0:
                self.cancelled.wait(left)
        self._step_started = time.monotonic()
