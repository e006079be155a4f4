"""Throughput benchmark: gymproxy against the bare relay floor, in front of one upstream, in one run.

Starts the canned vLLM (bench/upstream.py; or uses a real fleet given with --upstream), the floor
relay (bench/floor.py) and gymproxy (`python -m gymproxy serve`), each as its own process, and
drives each target in turn with a closed-loop load generator (bench/loadgen.py) at a fixed
concurrency for a fixed time. Targets and scenarios are interleaved and repeated in rounds, and
every figure printed is the median over rounds; ratios are taken within a round first.

Targets:
    upstream   the upstream itself (canned: its CPU; for streams, the TTFB to beat)
    floor      reads the body, posts the same bytes upstream, returns the reply (aiohttp's client)
    lean-floor the same relay through gymproxy's own upstream client (gymproxy.http1); opt-in
    gymproxy   gymproxy, with --workers N (several values give several targets)

The floor and the upstream are sent the chat body gymproxy itself would send upstream, so every
target makes the upstream do the same work.

    python bench/bench_proxy.py                                 # everything: 54 windows of 12 s, ~11 min
    python bench/bench_proxy.py --quick                         # 3 scenarios, floor and gymproxy, ~30 s
    python bench/bench_proxy.py --scenario responses --duration 5 --rounds 1
    python bench/bench_proxy.py --upstream http://gpu-node:8000/v1 --model Qwen/Qwen3-8B \\
        --set uses_reasoning_parser=true --concurrency 256 --duration 60
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import loadgen
import options
import orjson
import plot
from formats import Column, Table, csv_text, markdown
from procs import Service, cpu_seconds, free_port, set_cpus
from progress import Progress
from upstream import new_loop

BENCH = Path(__file__).resolve().parent
DATA = BENCH / "data"
LOOPBACK = "127.0.0.1"


class Scenario(NamedTuple):
    name: str
    route: str  # gymproxy's route; the floor and upstream get /v1/chat/completions
    request: str  # file in bench/data/
    reply: str  # the canned upstream's reply: "plain" or "tool"
    stream: bool
    about: str


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("chat", "/v1/chat/completions", "chat_request.json", "plain", False,
                 "content-only reply, passed through"),
        Scenario("chat-tool", "/v1/chat/completions", "chat_request.json", "tool", False,
                 "reply with reasoning (folded into <think>) and a tool call"),
        Scenario("responses", "/v1/responses", "responses_short.json", "tool", False,
                 "one user turn, 3 tools; reply with reasoning and a tool call"),
        Scenario("responses-multiturn", "/v1/responses", "responses_multiturn.json", "tool", False,
                 "30 input items (reasoning, calls, outputs); reply with reasoning and a tool call"),
        Scenario("chat-stream", "/v1/chat/completions", "chat_request.json", "tool", True,
                 "200-chunk stream: reasoning, text, a tool call"),
        Scenario("responses-stream", "/v1/responses", "responses_short.json", "tool", True,
                 "200-chunk stream: reasoning, text, a tool call, as Responses events"),
    )
}  # fmt: skip


# --- request bodies ----------------------------------------------------------------------------


@dataclass
class Bodies:
    """What each target is sent for one scenario."""

    proxy: bytes  # gymproxy: the scenario's own request
    chat: bytes  # the floor and the upstream: the chat body gymproxy sends upstream


def build_bodies(scenario: Scenario, args: argparse.Namespace, config: Any) -> Bodies:
    from gymproxy.convert.boundary import Boundary, Rules
    from gymproxy.convert.request import to_chat_body
    from gymproxy.proxy import rules
    from gymproxy.schemas import ENCODER
    from gymproxy.schemas.responses import REQUEST_DECODER

    request = json.loads((DATA / scenario.request).read_text())
    request["model"] = args.model if args.upstream else f"bench-{scenario.reply}"
    responses = scenario.route == "/v1/responses"
    if args.upstream:
        request["max_output_tokens" if responses else "max_tokens"] = args.max_tokens
    if scenario.stream:
        request["stream"] = True
        if not responses:
            request["stream_options"] = {"include_usage": True}
    proxy = orjson.dumps(request)
    if not responses:
        return Bodies(proxy, proxy)
    # As gymproxy's handler does it, so the floor's upstream request is the same one.
    req = REQUEST_DECODER.decode(proxy)
    chat = to_chat_body(req)
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return Bodies(proxy, ENCODER.encode(Boundary(rules(Rules, config)).prepare(chat)))


def gymproxy_config(args: argparse.Namespace, upstreams: list[str]) -> Any:
    from gymproxy.config import load_config

    overrides = dict(item.split("=", 1) for item in args.set)
    return load_config(args.config, overrides=overrides, extra={"base_url": upstreams}, environ={})


# --- checks ------------------------------------------------------------------------------------


class WrongReply(Exception):
    """A target answered, but not what the scenario expects."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise WrongReply(message)


def describe(scenario: Scenario, target: str, data: bytes, *, proxied: bool, canned: bool) -> str:
    """Check one full reply and say what it held; raises WrongReply when it is wrong.

    `proxied`: the target is a gymproxy, so a Responses scenario answers with a Response."""
    responses = scenario.route == "/v1/responses" and proxied
    if scenario.stream:
        if responses:
            events = [line[7:].decode() for line in data.split(b"\n") if line.startswith(b"event: ")]
            _expect(
                bool(events) and events[-1] == "response.completed", f"{target}: the stream ends with {events[-1:]}"
            )
            final = orjson.loads(data[data.rindex(b"data: ") + 6 :])["response"]
            kinds = [item["type"] for item in final["output"]]
            summary = f"{len(events)} events; output {kinds}"
        else:
            frames = [f[6:] for f in data.split(b"\n\n") if f.startswith(b"data: ")]
            _expect(bool(frames) and frames[-1] == b"[DONE]", f"{target}: the chat stream does not end with [DONE]")
            deltas = [c["choices"][0]["delta"] for c in map(orjson.loads, frames[:-1]) if c["choices"]]
            kinds = sorted({key for delta in deltas for key in delta})
            summary = f"{len(frames) - 1} chunks; delta keys {kinds}"
    elif responses:
        reply = orjson.loads(data)
        kinds = [item["type"] for item in reply["output"]]
        summary = f"status {reply['status']}; output {kinds}"
    else:
        message = orjson.loads(data)["choices"][0]["message"]
        summary = f"message keys with values {sorted(k for k, v in message.items() if v)}"
        kinds = [k for k, v in message.items() if v]
    if canned and scenario.reply == "tool":
        wanted = ("reasoning", "function_call") if responses else ("tool_calls",)
        flat = " ".join(map(str, kinds))
        _expect(
            all(w in flat for w in wanted), f"{target}/{scenario.name}: expected {wanted} in the reply, got {summary}"
        )
    return summary


# --- one run -----------------------------------------------------------------------------------


@dataclass
class Measure:
    round: int
    scenario: str
    target: str
    rps: float
    p50_ms: float | None
    p99_ms: float | None
    cpu_us: float | None  # CPU of the target's processes per request
    busy: float  # the target's CPU seconds per second
    upstream_busy: float | None
    loadgen_busy: float
    errors: int
    first_error: str | None
    frames: float | None = None  # upstream chunks per request (streams)
    ttfb_p50_ms: float | None = None
    ttfb_p99_ms: float | None = None


class Bench:
    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args = args
        self.log_dir = log_dir
        self.services: dict[str, Service] = {}
        self.upstreams: list[str] = []
        self.canned = not args.upstream

    # The processes.

    def start(self) -> None:
        args, py = self.args, sys.executable
        if self.canned:
            port = free_port()
            argv = [py, str(BENCH / "upstream.py"), "--port", str(port), "--chunk-interval", str(args.chunk_interval)]
            self._start(Service("upstream", argv, port, self.log_dir))
            self.upstreams = [f"http://{LOOPBACK}:{port}/v1"]
        else:
            self.upstreams = list(args.upstream)
        ups = [a for url in self.upstreams for a in ("--upstream", url)]
        if "floor" in args.targets:
            port = free_port()
            self._start(Service("floor", [py, str(BENCH / "floor.py"), *ups, "--port", str(port)], port, self.log_dir))
        if "lean-floor" in args.targets:
            port = free_port()
            argv = [py, str(BENCH / "floor.py"), *ups, "--port", str(port), "--client", "gymproxy"]
            self._start(Service("lean-floor", argv, port, self.log_dir))
        for name, command, workers in self.gymproxies():
            port = free_port()
            argv = [*command, "serve", *ups, "--host", LOOPBACK, "--port", str(port), "--workers", str(workers)]
            argv += ["--config", str(Path(args.config).resolve())] if args.config else []
            argv += [a for item in args.set for a in ("--set", item)]
            self._start(Service(name, argv, port, self.log_dir), processes=workers, marker=b" listening on http://")

    def gymproxies(self) -> list[tuple[str, list[str], int]]:
        """(target name, command, workers) of every gymproxy to run."""
        args = self.args
        if "gymproxy" not in args.targets:
            return []
        profile = str(Path(args.profile).resolve()) if args.profile else ""
        command = [sys.executable, "-m", "cProfile", "-o", profile] if args.profile else [sys.executable]
        out = [(gymproxy_name(w), [*command, "-m", "gymproxy"], w) for w in args.workers]
        out += [(name, shlex.split(variant), args.workers[0]) for name, variant in args.variant]
        return out

    def _start(self, service: Service, *, processes: int = 1, marker: bytes | None = None) -> None:
        self.services[service.name] = service
        service.start()
        service.wait_ready(processes=processes, marker=marker)
        if self.args.target_cpus and service.name != "upstream":
            set_cpus(service.pids, self.args.target_cpus)

    def stop(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()

    def target_url(self, target: str, scenario: Scenario) -> str:
        if target == "upstream":
            return f"{self.upstreams[0]}/chat/completions"
        route = scenario.route if self.proxied(target) else "/v1/chat/completions"
        return self.services[target].url + route

    def proxied(self, target: str) -> bool:
        return target not in ("upstream", "floor", "lean-floor")

    def targets(self) -> list[str]:
        names: list[str] = []
        for target in self.args.targets:
            names += [name for name, _, _ in self.gymproxies()] if target == "gymproxy" else [target]
        return names

    # The load.

    def probe(self, target: str) -> dict[str, float]:
        cpu = {"loadgen": cpu_seconds([os.getpid()])}
        if "upstream" in self.services:
            cpu["upstream"] = self.services["upstream"].cpu()
        if target in self.services:
            cpu["target"] = self.services[target].cpu()
        return cpu

    async def check(self, client: aiohttp.ClientSession, scenario: Scenario, target: str, body: bytes) -> str:
        async with client.post(self.target_url(target, scenario), data=body, headers=loadgen.HEADERS) as reply:
            data = await reply.read()
            if reply.status != 200:
                raise WrongReply(f"{target}/{scenario.name}: HTTP {reply.status}: {data[:500]!r}")
        return describe(scenario, target, data, proxied=self.proxied(target), canned=self.canned)

    async def measure(self, scenario: Scenario, target: str, body: bytes, round_: int) -> Measure:
        args = self.args
        responses = scenario.route == "/v1/responses" and self.proxied(target)
        async with loadgen.session(args.concurrency) as client:
            window = await loadgen.drive(
                client, self.target_url(target, scenario), body, stream=scenario.stream, responses=responses,
                concurrency=args.concurrency, warmup=args.warmup, duration=args.duration,
                probe=lambda: self.probe(target), rate=args.rate, rollouts=args.rollouts,
            )  # fmt: skip
        n, seconds = window.requests, window.seconds
        target_cpu = window.cpu.get("target")
        return Measure(
            round=round_,
            scenario=scenario.name,
            target=target,
            rps=window.rps,
            p50_ms=ms(loadgen.percentile(window.latencies, 0.50)),
            p99_ms=ms(loadgen.percentile(window.latencies, 0.99)),
            cpu_us=target_cpu / n * 1e6 if target_cpu is not None and n else None,
            busy=(target_cpu or 0.0) / seconds,
            upstream_busy=window.cpu["upstream"] / seconds if "upstream" in window.cpu else None,
            loadgen_busy=window.cpu["loadgen"] / seconds,
            errors=window.errors,
            first_error=window.first_error,
            frames=window.frames / n if scenario.stream and n else None,
            ttfb_p50_ms=ms(loadgen.percentile(window.ttfbs, 0.50)),
            ttfb_p99_ms=ms(loadgen.percentile(window.ttfbs, 0.99)),
        )

    async def run(self, progress: Progress) -> tuple[list[Measure], dict[str, dict[str, str]]]:
        args = self.args
        config = gymproxy_config(args, self.upstreams)
        scenarios = [SCENARIOS[name] for name in args.scenario]
        bodies = {s.name: build_bodies(s, args, config) for s in scenarios}
        targets = self.targets()

        def body(s: Scenario, target: str) -> bytes:
            return bodies[s.name].proxy if self.proxied(target) else bodies[s.name].chat

        checks: dict[str, dict[str, str]] = {}
        async with loadgen.session(1) as client:
            for s in scenarios:
                checks[s.name] = {t: await self.check(client, s, t, body(s, t)) for t in targets}
        measures = []
        for round_ in range(args.rounds):
            for s in scenarios:
                # Rotate the order each round so that no target always runs first (or last).
                shift = round_ % len(targets)
                for target in targets[shift:] + targets[:shift]:
                    m = await self.measure(s, target, body(s, target), round_)
                    measures.append(m)
                    progress.step(f"round {round_ + 1}/{args.rounds} {s.name:20} {target:12} {m.rps:8.0f} req/s"
                                  f"  cpu {_num(m.cpu_us, 0):>6} µs/req  errors {m.errors}")  # fmt: skip
        return measures, checks


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def gymproxy_name(workers: int) -> str:
    return "gymproxy" if workers == 1 else f"gymproxy-w{workers}"


# --- summary -----------------------------------------------------------------------------------


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(measures: list[Measure], scenarios: list[Scenario], targets: list[str]) -> dict[str, Any]:
    """Medians per scenario and target, plus the per-round ratios against floor and upstream."""
    out: dict[str, Any] = {}
    for s in scenarios:
        rows: dict[str, Any] = {}
        by = {t: [m for m in measures if m.scenario == s.name and m.target == t] for t in targets}
        for t, runs in by.items():
            row: dict[str, Any] = {
                key: _median(getattr(m, key) for m in runs)
                for key in ("rps", "p50_ms", "p99_ms", "cpu_us", "busy", "upstream_busy", "loadgen_busy", "frames",
                            "ttfb_p50_ms", "ttfb_p99_ms")
            }  # fmt: skip
            row["errors"] = sum(m.errors for m in runs)
            row["first_error"] = next((m.first_error for m in runs if m.first_error), None)
            floor = {m.round: m for m in by.get("floor", [])}
            upstream = {m.round: m for m in by.get("upstream", [])}
            chunks = _median(m.frames for m in by.get("floor", [])) if s.stream else None
            ratios, extra, ttfb = [], [], []
            for m in runs:
                f = floor.get(m.round)
                if f is not None and m.cpu_us is not None and f.cpu_us:
                    ratios.append(m.cpu_us / f.cpu_us)
                    if chunks:
                        extra.append((m.cpu_us - f.cpu_us) / chunks)
                u = upstream.get(m.round)
                if u is not None and m.ttfb_p50_ms is not None and u.ttfb_p50_ms is not None:
                    ttfb.append(m.ttfb_p50_ms - u.ttfb_p50_ms)
            row["x_floor"] = _median(ratios) if t != "floor" else (1.0 if ratios else None)
            if s.stream:
                row["chunks"] = chunks
                row["cpu_us_per_chunk"] = row["cpu_us"] / chunks if row["cpu_us"] is not None and chunks else None
                row["extra_us_per_chunk"] = _median(extra) if t != "floor" else None
                row["ttfb_vs_upstream_ms"] = _median(ttfb) if t != "upstream" else None
            rows[t] = row
        out[s.name] = rows
    return out


GOALS = (  # (label, scenario, key, limit, unit): what gymproxy may cost over the least any proxy costs
    ("/v1/responses CPU per request vs floor", "responses", "x_floor", 1.25, "x"),
    ("/v1/responses (30 items) CPU per request vs floor", "responses-multiturn", "x_floor", 1.25, "x"),
    ("/v1/chat/completions pass-through vs floor", "chat", "x_floor", 1.10, "x"),
    ("chat stream: CPU per chunk over the floor's", "chat-stream", "extra_us_per_chunk", 15.0, "µs"),
    ("responses stream: CPU per chunk over the floor's", "responses-stream", "extra_us_per_chunk", 15.0, "µs"),
    ("chat stream: TTFB p50 over the upstream's", "chat-stream", "ttfb_vs_upstream_ms", 1.0, "ms"),
    ("responses stream: TTFB p50 over the upstream's", "responses-stream", "ttfb_vs_upstream_ms", 1.0, "ms"),
)


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for label, scenario, key, limit, unit in GOALS:
        value = summary.get(scenario, {}).get("gymproxy", {}).get(key)
        if value is not None:
            out.append({"goal": label, "value": value, "limit": limit, "unit": unit, "met": value <= limit})
    return out


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(meta: dict[str, Any], summary: dict[str, Any], checks: dict[str, dict[str, str]]) -> str:
    rate = "" if meta["rate"] is None else f" at {meta['rate']:g} req/s"
    lines = [
        f"gymproxy bench, {meta['date']}: {meta['machine']}",
        f"loop {meta['loop']}; upstream {meta['upstream']}; concurrency {meta['concurrency']}{rate}; "
        f"{meta['duration']:g} s per target x {meta['rounds']} round(s), warm-up {meta['warmup']:g} s; medians",
        "CPU = utime+stime of the target's own processes per request; x floor = that over the floor's, per round",
    ]
    for name, rows in summary.items():
        s = SCENARIOS[name]
        lines += ["", f"{name}: {s.route}{' (stream)' if s.stream else ''}: {s.about}"]
        head = (
            f"  {'target':12} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU µs/req':>11} {'x floor':>8} {'CPU %':>6}"
        )
        if s.stream:
            head += f" {'chunks':>7} {'µs/chunk':>9} {'+µs/chunk':>10} {'TTFB ms':>8} {'+TTFB ms':>9}"
        lines.append(head)
        for target, r in rows.items():
            line = (
                f"  {target:12} {_num(r['rps'], 0):>8} {_num(r['p50_ms'], 2):>8} {_num(r['p99_ms'], 2):>8} "
                f"{_num(r['cpu_us'], 0):>11} {_num(r['x_floor'], 2):>8} {_num(r['busy'] * 100, 0):>6}"
            )
            if s.stream:
                line += (
                    f" {_num(r['chunks'], 0):>7} {_num(r['cpu_us_per_chunk'], 1):>9} {_num(r['extra_us_per_chunk'], 1):>10}"
                    f" {_num(r['ttfb_p50_ms'], 2):>8} {_num(r['ttfb_vs_upstream_ms'], 2):>9}"
                )
            if r["errors"]:
                line += f"  ERRORS {r['errors']}: {r['first_error']}"
            lines.append(line)
        notes = []
        for target, r in rows.items():
            if r["upstream_busy"] is not None and r["upstream_busy"] > 0.9 and target != "upstream":
                notes.append(
                    f"the upstream was {r['upstream_busy']:.0%} busy during {target}: it may be the bottleneck"
                )
            if r["loadgen_busy"] > 0.9:
                notes.append(
                    f"the load generator was {r['loadgen_busy']:.0%} busy during {target}: req/s understates it"
                )
        lines += [f"  note: {n}" for n in notes]
        if meta.get("verbose"):
            lines += [f"  reply from {t}: {text}" for t, text in checks.get(name, {}).items()]
    results = goals(summary)
    if results:
        lines += [
            "",
            "goals: gymproxy's cost over the floor's and its TTFB over the upstream's (medians of per-round values)",
        ]
        for g in results:
            value = f"{g['value']:.2f}{g['unit']}" if g["unit"] == "x" else f"{g['value']:.1f} {g['unit']}"
            limit = f"{g['limit']:.2f}{g['unit']}" if g["unit"] == "x" else f"{g['limit']:g} {g['unit']}"
            lines.append(f"  {g['goal']:52} {value:>9}   goal <= {limit:8}  {'met' if g['met'] else 'MISSED'}")
    return "\n".join(lines)


COLUMNS = (
    Column("target", "target"),
    Column("rps", "req/s", 0),
    Column("p50_ms", "p50 ms", 2),
    Column("p99_ms", "p99 ms", 2),
    Column("cpu_us", "CPU µs/req", 0),
    Column("x_floor", "x floor", 2),
    Column("cpu_pct", "CPU %", 0),
    Column("errors", "errors", 0),
)
STREAM_COLUMNS = (
    Column("chunks", "chunks", 0),
    Column("cpu_us_per_chunk", "µs/chunk", 1),
    Column("extra_us_per_chunk", "+µs/chunk", 1),
    Column("ttfb_p50_ms", "TTFB ms", 2),
    Column("ttfb_vs_upstream_ms", "+TTFB ms", 2),
)


def tables(summary: dict[str, Any]) -> list[Table]:
    """One table a scenario: the figures of the text tables, under the same names."""
    out = []
    for name, rows in summary.items():
        s = SCENARIOS[name]
        columns = COLUMNS + (STREAM_COLUMNS if s.stream else ())
        values = []
        for target, r in rows.items():
            row = {**r, "target": target, "cpu_pct": None if r["busy"] is None else r["busy"] * 100}
            values.append([row.get(c.key) for c in columns])
        out.append(Table(name, f"{name}: {s.route}{' (stream)' if s.stream else ''}: {s.about}", columns, values))
    return out


def render_markdown(meta: dict[str, Any], summary: dict[str, Any]) -> str:
    rate = "" if meta["rate"] is None else f" at {meta['rate']:g} req/s"
    head = (
        f"gymproxy bench, {meta['date']}: {meta['machine']}; {meta['loop']}; upstream {meta['upstream']}; "
        f"concurrency {meta['concurrency']}{rate}; {meta['duration']:g} s per target x {meta['rounds']} round(s), "
        f"warm-up {meta['warmup']:g} s; medians. CPU µs/req: utime+stime of the target's own processes per "
        "request; x floor: that over the floor's, per round."
    )
    parts = [head, markdown(tables(summary))]
    results = goals(summary)
    if results:
        columns = (Column("goal", "goal (gymproxy)"), Column("value", "value", 2), Column("limit", "at most", 2),
                   Column("unit", "unit"), Column("met", "met"))  # fmt: skip
        rows = [[g["goal"], g["value"], float(g["limit"]), g["unit"], "met" if g["met"] else "MISSED"] for g in results]
        parts.append(markdown([Table("goals", "goals", columns, rows)]))
    return "\n\n".join(parts)


def draw(path: str, measures: list[Measure], summary: dict[str, Any], targets: list[str]) -> None:
    """CPU µs per request, a panel a scenario: a bar a target (median of rounds, whiskers fewest to most)."""
    panels = []
    for name, rows in summary.items():
        bars, notes = {}, {}
        for target in targets:
            found = plot.bar([m.cpu_us for m in measures if m.scenario == name and m.target == target])
            if found is not None:
                bars["", target] = found
                ratio = rows.get(target, {}).get("x_floor")
                notes["", target] = "" if ratio is None or target == "floor" else f"{ratio:.2f}x"
        panels.append(plot.Panel(name, "CPU µs per request", [""], targets, bars, notes))
    rounds = max((m.round for m in measures), default=0) + 1
    title = f"CPU per request, median of {rounds} round(s)\n(whiskers: the least and the most; labels: x floor)"
    plot.write(path, title, panels)


def meta(args: argparse.Namespace, canned: bool) -> dict[str, Any]:
    try:
        import uvloop  # noqa: F401

        loop = "uvloop (floor, gymproxy, upstream, load generator)"
    except ImportError:
        loop = "asyncio (uvloop not installed)"
    import gymproxy

    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"aiohttp {aiohttp.__version__}, gymproxy {gymproxy.__version__}",
        "loop": loop,
        "upstream": f"canned (bench/upstream.py, a stream chunk every {args.chunk_interval * 1000:g} ms)"
        if canned
        else ", ".join(args.upstream) + f" (model {args.model})",
        "concurrency": args.concurrency,
        "rate": args.rate,
        "duration": args.duration,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "workers": args.workers,
        "verbose": args.verbose,
    }


def print_profile(path: str, limit: int = 30) -> None:
    import pstats

    stats = pstats.Stats(path, stream=sys.stdout)
    stats.strip_dirs().sort_stats("tottime").print_stats(limit)
    stats.sort_stats("cumulative").print_stats(limit)


# --- command line ------------------------------------------------------------------------------


def _names(text: str, known: Iterable[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return names


def _cpus(text: str) -> set[int]:
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--target-cpus takes CPU numbers like 1 or 2-3, got {text!r}") from None
    available = os.sched_getaffinity(0)
    if not cpus <= available or cpus == available:
        raise argparse.ArgumentTypeError(
            f"--target-cpus {text}: must be some, not all, of this machine's CPUs {sorted(available)}"
        )
    return cpus


def _variant(text: str) -> tuple[str, str]:
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or not command.strip() or name.strip() in ("upstream", "floor", "lean-floor"):
        raise argparse.ArgumentTypeError(f"--variant takes NAME=COMMAND, got {text!r}")
    return name.strip(), command


QUICK = {
    "scenario": ["responses", "responses-multiturn", "chat-stream"],
    "targets": ["floor", "gymproxy"],
    "duration": 1.5,
    "warmup": 0.5,
    "rounds": 2,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_proxy.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="scenarios:\n" + "\n".join(f"  {s.name:20} {s.route}: {s.about}" for s in SCENARIOS.values()),
    )  # fmt: skip
    parser.add_argument(
        "--scenario",
        type=lambda t: _names(t, SCENARIOS, "scenario"),
        default=list(SCENARIOS),
        help="comma-separated scenarios (default: all)",
    )
    parser.add_argument(
        "--targets",
        type=lambda t: _names(t, ("upstream", "floor", "lean-floor", "gymproxy"), "target"),
        default=["upstream", "floor", "gymproxy"],
        help="comma-separated: upstream,floor,lean-floor,gymproxy (default: all but lean-floor)",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="connections kept busy (default 16)")
    parser.add_argument(
        "--rate",
        type=float,
        metavar="REQ/S",
        help="space requests to this total rate (default: none, each connection sends back to back); "
        "compares targets at equal load, below the slowest one's capacity",
    )
    parser.add_argument(
        "--duration", type=float, default=10.0, help="measured seconds per target and round (default 10)"
    )
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each window (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="repeats; medians are reported (default 3)")
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1],
        metavar="N",
        help="gymproxy worker processes; several values measure each (default 1)",
    )
    parser.add_argument(
        "--upstream",
        action="append",
        metavar="URL",
        help="a real vLLM base URL ending in /v1 instead of the canned one (repeat for a fleet)",
    )
    parser.add_argument("--model", default="Qwen/Qwen3-8B", help="model name sent to a real --upstream")
    parser.add_argument("--max-tokens", type=int, default=200, help="reply length asked of a real --upstream")
    parser.add_argument(
        "--chunk-interval",
        type=float,
        default=0.001,
        help="canned upstream: seconds between stream chunks (0: the whole stream in one write)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=_variant,
        metavar="NAME=COMMAND",
        help="one more gymproxy target, started as `COMMAND serve ...` instead of `python -m gymproxy "
        "serve ...`, e.g. another checkout: 'new=/path/venv/bin/python -m gymproxy' (repeatable)",
    )
    parser.add_argument(
        "--target-cpus",
        type=_cpus,
        metavar="LIST",
        help="run the floor and gymproxy on these CPUs (e.g. 1 or 2-3) and the load generator and the canned "
        "upstream on the others, so they never compete for a core (default: no pinning)",
    )
    parser.add_argument("--config", help="gymproxy config file (also used to build the floor's chat bodies)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="passed to gymproxy serve")
    parser.add_argument(
        "--rollouts",
        type=int,
        default=0,
        metavar="N",
        help="send X-Rollout-ID on every request, a new rollout every N calls per connection (a captured load; "
        "turn capture on in a target with --set capture.enabled=true or a --variant)",
    )
    parser.add_argument("--profile", metavar="FILE", help="run gymproxy under cProfile, write FILE, print the top")
    parser.add_argument("--log-dir", help="keep the servers' logs here (default: a temporary directory)")
    parser.add_argument("--output", metavar="FILE", help="also write the JSON document to FILE")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show what each target replied")
    options.add(
        parser,
        quick="scenarios responses, responses-multiturn and chat-stream, targets floor and gymproxy, "
        "2 rounds of 1.5 s after 0.5 s: ~30 s",
        pictures="CPU µs per request, a panel a scenario, a bar a target with its spread over rounds",
    )
    args = options.parse(parser, argv, QUICK)
    if not args.upstream and not any(item.startswith("uses_reasoning_parser=") for item in args.set):
        args.set.append("uses_reasoning_parser=true")  # the canned replies carry reasoning
    if args.profile and args.workers != [1]:
        parser.error("--profile needs --workers 1 (cProfile sees one process)")
    if args.upstream and "upstream" in args.targets and len(args.upstream) > 1:
        print("note: the 'upstream' target hits only the first --upstream", file=sys.stderr)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gymproxy-bench-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        bench = Bench(args, log_dir)
        if args.target_cpus:  # this process (the load generator) and the upstream it starts keep the rest
            os.sched_setaffinity(0, os.sched_getaffinity(0) - args.target_cpus)
        loop = new_loop()
        try:
            progress = Progress(args.rounds * len(args.scenario) * len(bench.targets()), quiet=args.quiet)
            progress.say("starting the servers, then one checked reply per scenario and target")
            bench.start()
            measures, checks = loop.run_until_complete(bench.run(progress))
        except (WrongReply, RuntimeError) as exc:  # a server that did not start, or a wrong reply
            print(f"bench_proxy: {exc}", file=sys.stderr)
            return 2
        finally:
            bench.stop()
            loop.close()
    scenarios = [SCENARIOS[name] for name in args.scenario]
    summary = summarize(measures, scenarios, bench.targets())
    info = meta(args, bench.canned)
    document = {"meta": info, "summary": summary, "goals": goals(summary), "checks": checks,
                "measurements": [m.__dict__ for m in measures]}  # fmt: skip
    if args.output:
        Path(args.output).write_text(json.dumps(document, indent=1) + "\n")
    if args.format == "json":
        print(json.dumps(document, indent=1))
    elif args.format == "markdown":
        print(render_markdown(info, summary))
    elif args.format == "csv":
        print(csv_text(tables(summary), "scenario"))
    else:
        print(render(info, summary, checks))
    if args.plot:
        draw(args.plot, measures, summary, bench.targets())
    if args.profile:
        print_profile(args.profile)
    return 1 if any(m.errors for m in measures) else 0


if __name__ == "__main__":
    raise SystemExit(main())
