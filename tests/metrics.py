"""Reading the /metrics page: a metric's total, and waiting until the counters catch up or settle."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import METRICS_PORT, METRICS_REPORT_INTERVAL_S, wait_until


def total(metrics: dict[str, Any], name: str, **labels: str) -> float:
    """Sum of a series over replicas (and other labels) matching ``labels``; 0 when absent."""
    return sum(v for got, v in metrics.get(name, []) if all(got.get(k) == want for k, want in labels.items()))


def caught_up(condition: Callable[[dict[str, Any]], Any], timeout_s: float = 60) -> dict[str, Any]:
    """Metrics reach the node's endpoint within a report interval of being recorded: the first scrape they show in.

    ``condition`` returns True when they did, else what it saw (shown if they never do).
    """
    seen: list[Any] = [None]

    def scraped() -> dict[str, Any] | None:
        metrics = scrape()
        seen[0] = condition(metrics)
        return metrics if seen[0] is True else None

    return wait_until(scraped, timeout_s, lambda: f"the metrics to catch up with the requests: {seen[0]}", 0.5)


def settled(timeout_s: float = 120) -> dict[str, Any]:
    """A scrape once earlier work has been reported: two scrapes more than a report interval apart agree."""
    previous: list[dict[str, Any]] = [scrape()]

    def agrees() -> dict[str, Any] | None:
        time.sleep(METRICS_REPORT_INTERVAL_S + 1)
        current, before = scrape(), previous[0]
        previous[0] = current
        same = all(total(current, name) == total(before, name) for name in before if name.startswith("ray_omni_"))
        return current if same else None

    return wait_until(agrees, timeout_s, "the omni_serve metrics to stop moving", interval_s=0)


def scrape() -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples
