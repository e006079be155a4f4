"""Per-app counters and histograms, rendered in the Prometheus text format at `GET /metrics`.

No global registry: each mounted gymproxy owns one `Metrics`, so two apps (or two tests) in one
process never mix their numbers. Recording is a dict update or a bisect, cheap enough for the hot
path. `merge` folds the texts of the workers of one `gymproxy serve --workers N` into one scrape
(see `peers`): counters and histograms summed per label set, gauges summed or labelled per worker.
"""

from __future__ import annotations

import bisect
import platform
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector

from . import __version__

_PROCESS = CollectorRegistry(auto_describe=True)  # the process's own: one per process, not per app
ProcessCollector(registry=_PROCESS)

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PAUSE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
VERSIONS_COUNTED = 64
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
                yield f'{name}_bucket{{{label_name}="{label}",le="{bound}"}} {number(cumulative)}'
            yield f'{name}_count{{{label_name}="{label}"}} {number(cumulative)}'
            yield f'{name}_sum{{{label_name}="{label}"}} {number(series[-1])}'


class Metrics:
    """Everything `/metrics` reports for one gymproxy."""

    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.upstream_requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.duration = Histogram(DURATION_BUCKETS)
        self.ttfb = Histogram(TTFB_BUCKETS)
        self.overflows = 0
        # From the upstream replies' `usage`, by upstream; cached/prompt is its prefix-cache hit rate.
        self.prompt_tokens: defaultdict[str, int] = defaultdict(int)
        self.cached_prompt_tokens: defaultdict[str, int] = defaultdict(int)
        self.completion_tokens: defaultdict[str, int] = defaultdict(int)
        self.upstream_duration = Histogram(DURATION_BUCKETS)  # a reply's time at its upstream, by upstream
        self.pauses = Histogram(PAUSE_BUCKETS)  # seconds the fleet was paused (`/fleet/pause`), by mode
        self.by_version: dict[str, int] = {}  # replies, by the weight version that sampled them

    def count_version(self, version: str) -> None:
        """One more reply sampled with `version`; only the latest `VERSIONS_COUNTED` are kept."""
        counted = self.by_version
        if version in counted:
            counted[version] += 1
            return
        if len(counted) >= VERSIONS_COUNTED:
            del counted[next(iter(counted))]  # the oldest version first seen
        counted[version] = 1

    def render(
        self,
        gauges: Iterable[tuple[str, str, str, Callable[[], Iterable[tuple[str, float]]]]],
        histograms: Iterable[tuple[Histogram, str, str, str]] = (),
    ) -> str:
        """The text of /metrics: these metrics, then `gauges` and `histograms` (histogram, name, help,
        label name) of other parts, then the process's own."""
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
        lines += _by_upstream(
            "gymproxy_upstream_prompt_tokens_total",
            "Prompt tokens of the replies read, by upstream (usage.prompt_tokens; relayed routes not counted).",
            self.prompt_tokens,
        )
        lines += _by_upstream(
            "gymproxy_upstream_cached_prompt_tokens_total",
            "Of those, served from vLLM's prefix cache (usage.prompt_tokens_details.cached_tokens).",
            self.cached_prompt_tokens,
        )
        lines += _by_upstream(
            "gymproxy_upstream_completion_tokens_total",
            "Generated tokens of the replies read, by upstream (usage.completion_tokens): its rate is tokens/s.",
            self.completion_tokens,
        )
        lines += self.upstream_duration.render(
            "gymproxy_upstream_duration_seconds",
            "Time from sending a request upstream to the end of its reply, by upstream (converted routes).",
            "upstream",
        )
        lines += [
            "# HELP gymproxy_build_info gymproxy's version and Python's (always 1).",
            "# TYPE gymproxy_build_info gauge",
            f'gymproxy_build_info{{version="{__version__}",python="{platform.python_version()}"}} 1',
        ]
        lines += [
            "# HELP gymproxy_context_overflows_total vLLM context-length 400s seen.",
            "# TYPE gymproxy_context_overflows_total counter",
            f"gymproxy_context_overflows_total {self.overflows}",
        ]
        lines += self.pauses.render(
            "gymproxy_fleet_pause_seconds",
            "How long the fleet was paused (/fleet/pause to /fleet/resume), by mode.",
            "mode",
        )
        lines += [
            "# HELP gymproxy_replies_by_weight_version_total Replies, by the weight version(s) that sampled them "
            "(X-Weight-Version; the latest 64 versions).",
            "# TYPE gymproxy_replies_by_weight_version_total counter",
            *(
                f'gymproxy_replies_by_weight_version_total{{version="{_escape(v)}"}} {n}'
                for v, n in self.by_version.items()
            ),
        ]
        for name, kind, help_text, values in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for label, value in values():
                lines.append(f"{name}{label} {number(value)}")
        for histogram, name, help_text, label_name in histograms:
            lines += histogram.render(name, help_text, label_name)
        return "\n".join(lines) + "\n" + process_metrics()


def process_metrics() -> str:
    """prometheus_client's `process_*` series (CPU seconds, memory, open files, start time) of this process."""
    return generate_latest(_PROCESS).decode()


def _counter(name: str, help_text: str, labels: tuple[str, str], values: dict[tuple[str, int], int]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    for (a, b), count in sorted(values.items()):
        lines.append(f'{name}{{{labels[0]}="{_escape(a)}",{labels[1]}="{b}"}} {count}')
    return lines


def _by_upstream(name: str, help_text: str, values: dict[str, int]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    lines += [f'{name}{{upstream="{_escape(u)}"}} {count}' for u, count in sorted(values.items())]
    return lines


def label(**labels: str) -> str:
    """A Prometheus label set, `{name="value",...}`, with values escaped."""
    inner = ",".join(f'{name}="{_escape(value)}"' for name, value in labels.items())
    return f"{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def number(value: float) -> str:
    """A sample value, exact: `:g` would print 1234567 requests as 1.23457e+06."""
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


# Gauges whose value for the whole server is the sum of the workers' (each worker has its own
# connections and slots). Every other gauge is a per-worker fact (a worker's own health checks, its
# own circuit breaker) and keeps one series per worker, labelled `worker`.
SUMMED_GAUGES = frozenset({"gymproxy_upstream_inflight", "gymproxy_held_requests"})
SUMMED_KINDS = frozenset({"counter", "histogram", "summary", "untyped"})
# Facts of the parent process that every worker repeats (the launched replicas: the parent runs
# them and writes their states for the workers): taken once, from the first worker that has them,
# so a restart is not counted once per worker.
SHARED = frozenset({"gymproxy_replica_ready", "gymproxy_replica_starts_total"})


class _Family:
    __slots__ = ("help", "kind", "samples")

    def __init__(self) -> None:
        self.help = ""
        self.kind = "untyped"
        self.samples: dict[str, float] = {}  # `name{labels}` -> value, in first-seen order


def merge(texts: Sequence[str | None]) -> str:
    """One scrape from the texts of every worker (index = worker; None: it did not answer in time).

    Counters and histogram buckets, sums and counts add up per label set, so a rate over the result
    counts each request once. Gauges in `SUMMED_GAUGES` add up too; every other gauge gets a
    `worker` label; those in `SHARED` are taken once. `gymproxy_metrics_workers`, `gymproxy_metrics_workers_missing` and
    `gymproxy_metrics_worker_up{worker}` say whose numbers are in it.
    """
    families: dict[str, _Family] = {}
    for worker, text in enumerate(texts):
        if text is not None:
            _fold(families, text, str(worker))
    lines: list[str] = []
    for name, family in families.items():
        lines += [f"# HELP {name} {family.help}", f"# TYPE {name} {family.kind}"]
        lines += [f"{series} {number(value)}" for series, value in family.samples.items()]
    missing = [str(worker) for worker, text in enumerate(texts) if text is None]
    lines += [
        "# HELP gymproxy_metrics_workers Worker processes this scrape should cover.",
        "# TYPE gymproxy_metrics_workers gauge",
        f"gymproxy_metrics_workers {len(texts)}",
        "# HELP gymproxy_metrics_workers_missing Workers that did not answer this scrape in time (their numbers are left out).",
        "# TYPE gymproxy_metrics_workers_missing gauge",
        f"gymproxy_metrics_workers_missing {len(missing)}",
        "# HELP gymproxy_metrics_worker_up 1 if the worker's numbers are in this scrape.",
        "# TYPE gymproxy_metrics_worker_up gauge",
    ]
    lines += [f'gymproxy_metrics_worker_up{{worker="{w}"}} {int(t is not None)}' for w, t in enumerate(texts)]
    return "\n".join(lines) + "\n"


def _fold(families: dict[str, _Family], text: str, worker: str) -> None:
    """Add one worker's text (as `Metrics.render` writes it: each family's samples follow its TYPE)."""
    family = _Family()
    for line in text.splitlines():
        if line.startswith("# "):
            _, directive, name, *rest = line.split(" ", 3)
            family = families.setdefault(name, _Family())
            if directive == "HELP":
                family.help = rest[0] if rest else ""
            elif directive == "TYPE" and rest:
                family.kind = rest[0]
            continue
        if not line:
            continue
        series, _, value = line.rpartition(" ")
        if series.partition("{")[0] in SHARED:
            family.samples.setdefault(series, float(value))
            continue
        if family.kind not in SUMMED_KINDS and not _summed_gauge(series):
            series = _with_worker(series, worker)
        family.samples[series] = family.samples.get(series, 0.0) + float(value)


def _summed_gauge(series: str) -> bool:
    return series.partition("{")[0] in SUMMED_GAUGES


def _with_worker(series: str, worker: str) -> str:
    if series.endswith("}"):
        return f'{series[:-1]},worker="{worker}"}}'
    return f'{series}{{worker="{worker}"}}'
