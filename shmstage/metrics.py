"""Counters and histograms, and their Prometheus text rendering.

The daemon keeps the numbers (only its event loop updates them) and hands out a plain
snapshot — dicts, lists and numbers that travel as msgpack. Rendering the Prometheus text
format lives here in the core so that ``shmstage metrics`` (which asks the daemon for a
snapshot over its socket) and the daemon's own HTTP endpoint print exactly the same thing.
No client library: the text format is a few lines per metric.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["BYTE_BUCKETS", "SECOND_BUCKETS", "Histogram", "Registry", "render"]

#: Stall and persist times span a millisecond copy to a minutes-long write.
SECOND_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
)
#: Checkpoint sizes from a toy model to a large shard.
BYTE_BUCKETS: tuple[float, ...] = tuple(float(1 << s) for s in range(20, 42, 2))

Labels = tuple[tuple[str, str], ...]


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: each bucket counts values ≤ le)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            cumulative.append(["+Inf" if math.isinf(bound) else bound, running])
        return {"buckets": cumulative, "sum": self.sum, "count": self.count}


class Registry:
    """Named metrics with optional labels. Not thread-safe by design: one owner updates it."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._meta: dict[str, tuple[str, str, Sequence[float]]] = {}
        self._values: dict[str, dict[Labels, float | Histogram]] = {}

    def counter(self, name: str, help_: str, *, labelled: bool = False) -> None:
        self._declare(name, "counter", help_, (), labelled)

    def gauge(self, name: str, help_: str) -> None:
        self._declare(name, "gauge", help_, (), False)

    def histogram(self, name: str, help_: str, buckets: Sequence[float]) -> None:
        self._declare(name, "histogram", help_, buckets, False)

    def _declare(
        self, name: str, kind: str, help_: str, buckets: Sequence[float], labelled: bool
    ) -> None:
        """Unlabelled series exist from the start, so a scrape shows 0 rather than nothing."""
        self._meta[name] = (kind, help_, tuple(buckets))
        series = self._values.setdefault(name, {})
        if not labelled:
            series[()] = Histogram(buckets) if kind == "histogram" else 0.0

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        series = self._values[name]
        key = _labels(labels)
        series[key] = float(series.get(key, 0.0)) + amount  # type: ignore[arg-type]

    def set(self, name: str, value: float, **labels: str) -> None:
        self._values[name][_labels(labels)] = float(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        series = self._values[name]
        key = _labels(labels)
        histogram = series.get(key)
        if not isinstance(histogram, Histogram):
            histogram = series[key] = Histogram(self._meta[name][2])
        histogram.observe(value)

    def value(self, name: str, **labels: str) -> float:
        found = self._values[name].get(_labels(labels), 0.0)
        return float(found.count if isinstance(found, Histogram) else found)

    def snapshot(self) -> dict[str, Any]:
        """Plain data: ``{full_name: {"type", "help", "series": [[labels, value]]}}``."""
        out: dict[str, Any] = {}
        for name, (kind, help_, _) in self._meta.items():
            series = [
                [dict(labels), value.snapshot() if isinstance(value, Histogram) else value]
                for labels, value in sorted(self._values[name].items())
            ]
            out[f"{self.namespace}_{name}"] = {"type": kind, "help": help_, "series": series}
        return out


def _labels(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(labels: Iterable[tuple[str, Any]]) -> str:
    parts = [f'{k}="{_escape(str(v))}"' for k, v in labels]
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def render(snapshot: Mapping[str, Any]) -> str:
    """The Prometheus text exposition format (version 0.0.4) of a Registry snapshot."""
    lines: list[str] = []
    for name, metric in snapshot.items():
        kind = metric["type"]
        lines.append(f"# HELP {name} {_escape(metric['help'])}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in metric["series"]:
            pairs = list(labels.items())
            if kind != "histogram":
                lines.append(f"{name}{_label_text(pairs)} {_number(value)}")
                continue
            for bound, count in value["buckets"]:
                le = bound if isinstance(bound, str) else _number(bound)
                lines.append(f"{name}_bucket{_label_text([*pairs, ('le', le)])} {count}")
            lines.append(f"{name}_sum{_label_text(pairs)} {_number(value['sum'])}")
            lines.append(f"{name}_count{_label_text(pairs)} {value['count']}")
    return "\n".join(lines) + "\n"
