"""Per-app counters and histograms, rendered in the Prometheus text format at `GET /metrics`.

No global registry: each mounted gymproxy owns one `Metrics`, so two apps (or two tests) in one
process never mix their numbers. Recording is a dict update or a bisect, cheap enough for the hot
path.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """A Prometheus histogram with fixed buckets, one series per label value."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.series: dict[str, list[float]] = {}  # label -> [count per bucket..., +Inf count, sum]

    def observe(self, label: str, value: float) -> None:
        series = self.series.get(label)
        if series is None:
            series = self.series[label] = [0.0] * (len(self.buckets) + 2)
        series[bisect.bisect_left(self.buckets, value)] += 1
        series[-1] += value

    def render(self, name: str, help_text: str, label_name: str) -> Iterable[str]:
        yield f"# HELP {name} {help_text}"
        yield f"# TYPE {name} histogram"
        for label, series in sorted(self.series.items()):
            cumulative = 0.0
            for bound, count in zip((*self.buckets, "+Inf"), series, strict=False):
                cumulative += count
                yield f'{name}_bucket{{{label_name}="{label}",le="{bound}"}} {cumulative:g}'
            yield f'{name}_count{{{label_name}="{label}"}} {cumulative:g}'
            yield f'{name}_sum{{{label_name}="{label}"}} {series[-1]:.6f}'


class Metrics:
    """Everything `/metrics` reports for one gymproxy."""

    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.upstream_requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.duration = Histogram(DURATION_BUCKETS)
        self.ttfb = Histogram(TTFB_BUCKETS)
        self.overflows = 0

    def render(self, gauges: Iterable[tuple[str, str, str, Callable[[], Iterable[tuple[str, float]]]]]) -> str:
        lines: list[str] = []
        lines += _counter(
            "gymproxy_requests_total", "Requests served, by route and status.", ("route", "status"), self.requests
        )
        lines += self.duration.render(
            "gymproxy_request_duration_seconds", "Time to serve a request, by route.", "route"
        )
        lines += self.ttfb.render("gymproxy_stream_ttfb_seconds", "Time to the first streamed byte, by route.", "route")
        lines += _counter(
            "gymproxy_upstream_requests_total",
            "Requests sent upstream, by upstream and status (0: no answer).",
            ("upstream", "status"),
            self.upstream_requests,
        )
        lines += [
            "# HELP gymproxy_context_overflows_total vLLM context-length 400s seen.",
            "# TYPE gymproxy_context_overflows_total counter",
            f"gymproxy_context_overflows_total {self.overflows}",
        ]
        for name, kind, help_text, values in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for label, value in values():
                lines.append(f"{name}{label} {value:g}")
        return "\n".join(lines) + "\n"


def _counter(name: str, help_text: str, labels: tuple[str, str], values: dict[tuple[str, int], int]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    for (a, b), count in sorted(values.items()):
        lines.append(f'{name}{{{labels[0]}="{_escape(a)}",{labels[1]}="{b}"}} {count}')
    return lines


def label(**labels: str) -> str:
    """A Prometheus label set, `{name="value",...}`, with values escaped."""
    inner = ",".join(f'{name}="{_escape(value)}"' for name, value in labels.items())
    return f"{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
