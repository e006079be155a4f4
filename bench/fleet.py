"""A simulated fleet: how well each router keeps prefix caches hot and engines evenly loaded.

Each run starts a fresh fleet of simulated vLLM engines (`sim_engines.py`, one process), one
router in front of it (a target), and drives many concurrent multi-turn agent sessions through it
on `/v1/chat/completions`. Scenarios change the fleet: one engine 3x slower, an engine added or
killed mid-run, prefill that stalls the whole batch. See bench/README.md ("fleet.py").

    python bench/fleet.py --scenarios balanced,slow --targets round-robin,hash-mod-n,gymproxy
    python bench/fleet.py --variant 'new=/work/wt-x/.venv/bin/python -m gymproxy' --check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import Service, free_port  # noqa: E402

BENCH = Path(__file__).resolve().parent
LOOPBACK = "127.0.0.1"
ROUTER_POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin")
BUILTIN = {"round-robin": "round_robin", "hash-mod-n": "hash_mod_n"}
STICKY_BASELINES = ("hash-mod-n", "vllm-router:cache_aware", "vllm-router:consistent_hash")
CLIENT_KINDS = ("cookie", "x-session-id", "session-id", "user")


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    slow: float = 1.0  # slowdown of engine 0
    gpu_prefill: bool = False
    event: str = ""  # "kill" or "add", at `event_at` of the measured window


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("balanced", "N equal engines"),
        Scenario("slow", "engine e0 is 3x slower", slow=3.0),
        Scenario("add", "an engine joins mid-run", event="add"),
        Scenario("kill", "engine e1 is killed mid-run (listener closed, connections reset)", event="kill"),
        Scenario("gpu-prefill", "N equal engines; a prefill stalls the whole batch", gpu_prefill=True),
    )
}


# --- the workload ----------------------------------------------------------------------------------


def words(rng: random.Random, n: int, prefix: str) -> str:
    return " ".join(f"{prefix}{rng.randrange(20000)}" for _ in range(n))


@dataclass
class Turn:
    session: str
    kind: str
    rid: str
    start: float
    end: float = 0.0
    ok: bool = False
    stream: bool = False
    error: str = ""


@dataclass
class Workload:
    """Sessions of task families (shared system prompts), geometric numbers of turns, tool results."""

    sessions: int = 96
    families: int = 8
    system_words: int = 1000
    mean_turns: float = 8.0
    max_turns: int = 40
    tool_words: int = 120
    answer_tokens: tuple[int, int] = (20, 60)
    think: tuple[float, float] = (0.05, 0.3)
    stream_share: float = 0.25
    retries: int = 2
    seed: int = 1
    systems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.systems = [words(random.Random(f"family{f}"), self.system_words, f"f{f}w") for f in range(self.families)]


class Driver:
    """Keeps `sessions` agent sessions going against `url` until `stop`; records every turn."""

    def __init__(self, work: Workload, url: str, tag: str, *, rid_header: bool = True) -> None:
        self.work = work
        self.rid_header = rid_header
        self.url = url + "/v1/chat/completions"
        self.tag = tag
        self.turns: list[Turn] = []
        self.started = 0
        self.session_start: dict[str, float] = {}
        self.stop_at = 0.0
        self.rng = random.Random(work.seed)

    async def run(self, seconds: float) -> None:
        self.stop_at = time.monotonic() + seconds
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()
        ) as http:
            await asyncio.gather(*(self.slot(http, i) for i in range(self.work.sessions)))

    async def slot(self, http: aiohttp.ClientSession, slot: int) -> None:
        await asyncio.sleep(slot * 0.01)  # a ramp, not a thundering herd
        while time.monotonic() < self.stop_at:
            await self.session(http)

    async def session(self, http: aiohttp.ClientSession) -> None:
        work, rng = self.work, self.rng
        n = self.started
        self.started += 1
        sid = f"{self.tag}-s{n}"
        self.session_start[sid] = time.monotonic()
        kind = CLIENT_KINDS[n % len(CLIENT_KINDS)]
        family = min(int(rng.paretovariate(1.2)) - 1, work.families - 1)  # skewed: family 0 is the most common
        turns = min(work.max_turns, 1 + int(rng.expovariate(1 / (work.mean_turns - 1))))
        stream = rng.random() < work.stream_share
        messages: list[dict[str, str]] = [
            {"role": "system", "content": work.systems[family]},
            {"role": "user", "content": f"task {sid}: " + words(rng, 80, "u")},
        ]
        cookies: dict[str, str] = {}
        for t in range(turns):
            for attempt in range(work.retries + 1):
                if time.monotonic() >= self.stop_at:
                    return
                turn = Turn(sid, kind, f"{sid}-t{t}-a{attempt}", time.monotonic(), stream=stream)
                self.turns.append(turn)
                answer = await self.post(http, turn, messages, cookies, rng.randint(*work.answer_tokens))
                turn.end = time.monotonic()
                if answer is not None:
                    break
                await asyncio.sleep(0.5)
            else:
                return  # the rollout gives up
            messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": "tool result: " + words(rng, work.tool_words, "r")})
            await asyncio.sleep(rng.uniform(*work.think))

    async def post(
        self,
        http: aiohttp.ClientSession,
        turn: Turn,
        messages: list[dict[str, str]],
        cookies: dict[str, str],
        max_tokens: int,
    ) -> str | None:
        body: dict[str, Any] = {"model": "sim", "messages": messages, "max_tokens": max_tokens}
        # vllm-router's consistent_hash keys on X-Request-Id before the body's `user`: there the id
        # goes in the body (vLLM's own `request_id` field), which the engines read too.
        headers = {"X-Request-Id": turn.rid} if self.rid_header else {}
        if not self.rid_header:
            body["request_id"] = turn.rid
        if turn.kind == "cookie" and cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
        elif turn.kind == "x-session-id":
            headers["X-Session-ID"] = turn.session
        elif turn.kind == "session-id":
            headers["session-id"] = turn.session
        elif turn.kind == "user":
            body["user"] = turn.session
        if turn.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        try:
            async with http.post(self.url, json=body, headers=headers) as reply:
                if turn.kind == "cookie":
                    cookies.update({k: m.value for k, m in reply.cookies.items()})
                if reply.status != 200:
                    turn.error = f"{reply.status} {(await reply.text())[:120]}"
                    return None
                if not turn.stream:
                    content = (await reply.json())["choices"][0]["message"]["content"]
                else:
                    content, done = "", False
                    async for line in reply.content:
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif line.startswith(b"data: "):
                            for choice in json.loads(line[6:]).get("choices", []):
                                content += choice.get("delta", {}).get("content") or ""
                    if not done:
                        turn.error = "stream ended without [DONE]"
                        return None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            turn.error = repr(exc)[:120]
            return None
        turn.ok = True
        return str(content)


# --- targets -----------------------------------------------------------------------------------------


def router_binary() -> str | None:
    """vllm-router from PATH or the bench venv (~/.cache/gymproxy/bench-venv), else None."""
    found = shutil.which("vllm-router")
    cached = Path.home() / ".cache/gymproxy/bench-venv/bin/vllm-router"
    return found or (str(cached) if cached.exists() else None)


def start_target(name: str, args: argparse.Namespace, upstreams: list[str], log_dir: Path) -> Service:
    port = free_port()
    if name in BUILTIN:
        argv = [sys.executable, str(BENCH / "sim_balancer.py"), "--policy", BUILTIN[name], "--port", str(port)]
        argv += [a for u in upstreams for a in ("--upstream", u)]
        service = Service(name, argv, port, log_dir)
    elif name.startswith("vllm-router:"):
        binary = router_binary()
        assert binary is not None
        bases = [u.removesuffix("/v1") for u in upstreams]
        argv = [binary, "--host", LOOPBACK, "--port", str(port), "--policy", name.split(":", 1)[1]]
        argv += ["--worker-urls", *bases, "--log-level", "warning", "--health-check-interval-secs", "2"]
        service = Service(name, argv, port, log_dir, ready_path="/health")
    else:
        command = [sys.executable, "-m", "gymproxy"] if name == "gymproxy" else shlex.split(dict(args.variant)[name])
        argv = [*command, "serve", "--host", LOOPBACK, "--port", str(port), "--model", "sim"]
        argv += [a for u in upstreams for a in ("--upstream", u)]
        argv += [a for item in args.set for a in ("--set", item)]
        service = Service(name, argv, port, log_dir, ready_path="/health")
    service.start()
    service.wait_ready(timeout=60)
    return service


def post(url: str, data: Any = None, timeout: float = 5) -> tuple[int, str]:
    body = json.dumps(data).encode() if data is not None else b""
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:200]
    except OSError as exc:
        return 0, repr(exc)


def add_upstream(target: str, base: str, url: str) -> str:
    """Tell the target about a new engine at `url` (ending in /v1); says how, or why it could not."""
    if target.startswith("vllm-router:"):
        engine = url.removesuffix("/v1")
        status, text = post(f"{base}/add_worker?url={engine}")
        if status // 100 == 2:
            return "added by POST /add_worker"
        status2, text2 = post(f"{base}/workers", {"url": engine})
        if status2 // 100 == 2:
            return "added by POST /workers"
        return f"needs a restart (POST /add_worker: {status}, POST /workers: {status2})"
    status, text = post(f"{base}/admin/upstreams", {"url": url})
    if status // 100 == 2:
        return "added by POST /admin/upstreams"
    return f"needs a restart (POST /admin/upstreams: {status})"


# --- one run -----------------------------------------------------------------------------------------


def engine_specs(args: argparse.Namespace, scenario: Scenario) -> list[dict[str, Any]]:
    count = args.engines + (1 if scenario.event == "add" else 0)
    specs = []
    for i in range(count):
        specs.append(
            {
                "name": f"e{i}",
                "port": free_port(),
                "slowdown": scenario.slow if i == 0 else 1.0,
                "gpu_prefill": scenario.gpu_prefill,
                "cache_blocks": args.cache_blocks,
                "step_base": args.step_base,
                "step_per_seq": args.step_per_seq,
                "prefill_per_token": args.prefill_per_token,
                "late": i >= args.engines,
            }
        )
    return specs


async def run_once(
    args: argparse.Namespace, scenario: Scenario, target: str, rep: int, log_dir: Path
) -> dict[str, Any]:
    specs = engine_specs(args, scenario)
    control = free_port()
    engines = Service(
        "engines",
        [sys.executable, str(BENCH / "sim_engines.py"), "--control-port", str(control), "--spec", json.dumps(specs)],
        control,
        log_dir,
    )
    engines.start()
    service = None
    try:
        engines.wait_ready()
        upstreams = [f"http://{LOOPBACK}:{s['port']}/v1" for s in specs if not s["late"]]
        service = start_target(target, args, upstreams, log_dir)
        work = Workload(sessions=args.sessions, seed=args.seed + rep)
        driver = Driver(work, service.url, f"r{rep}", rid_header=not target.startswith("vllm-router:"))
        t0 = time.monotonic()
        window = (t0 + args.warmup, t0 + args.warmup + args.duration)
        event_time, event_note = 0.0, ""

        async def event() -> None:
            nonlocal event_time, event_note
            await asyncio.sleep(args.warmup + args.duration * args.event_at)
            event_time = time.monotonic()
            if scenario.event == "kill":
                await asyncio.to_thread(post, f"http://{LOOPBACK}:{control}/kill/1")
            elif scenario.event == "add":
                late = specs[-1]
                await asyncio.to_thread(post, f"http://{LOOPBACK}:{control}/start/{len(specs) - 1}")
                url = f"http://{LOOPBACK}:{late['port']}/v1"
                event_note = await asyncio.to_thread(add_upstream, target, service.url, url)

        tasks = [driver.run(args.warmup + args.duration)]
        if scenario.event:
            tasks.append(event())
        cpu = service.cpu()
        await asyncio.gather(*tasks)
        cpu = service.cpu() - cpu
        await asyncio.sleep(0.2)
        with urllib.request.urlopen(f"http://{LOOPBACK}:{control}/stats", timeout=10) as reply:
            stats = json.loads(reply.read())["engines"]
    finally:
        if service is not None:
            service.stop()
        engines.stop()
    row = measure(scenario, target, driver, stats, window, event_time, event_note, args.engines)
    completed = sum(1 for t in driver.turns if t.ok)
    row["cpu_ms"] = 1000 * cpu / completed if completed else None  # the router's own CPU per turn
    return row


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(
    scenario: Scenario,
    target: str,
    driver: Driver,
    stats: list[dict[str, Any]],
    window: tuple[float, float],
    event_time: float,
    event_note: str,
    engines: int,
) -> dict[str, Any]:
    start, end = window
    served: dict[str, list[tuple[str, float, int, int, int]]] = defaultdict(list)  # rid -> engine records
    for engine in stats:
        for rid, done, prompt, cached, gen in engine["records"]:
            served[rid].append((engine["name"], done, prompt, cached, gen))
    turns = [t for t in driver.turns if t.end and start <= t.end < end]
    ok = [t for t in turns if t.ok]
    failed = [t for t in driver.turns if t.end and not t.ok and t.end >= start]
    prompt = cached = 0
    per_engine: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    for t in ok:
        for name, _done, p, c, g in served.get(t.rid, [])[:1]:
            prompt, cached = prompt + p, cached + c
            per_engine[name] += p + g
            requests[name] += 1
    by_session: dict[str, set[str]] = defaultdict(set)
    for t in driver.turns:
        for name, *_ in served.get(t.rid, []):
            by_session[t.session].add(name)
    latencies = [t.end - t.start for t in ok]
    loads = [per_engine[e["name"]] for e in stats if per_engine[e["name"]]]
    row: dict[str, Any] = {
        "scenario": scenario.name,
        "target": target,
        "turns": len(ok),
        "turns_s": len(ok) / (end - start),
        "hit": cached / prompt if prompt else 0.0,
        "p50": _pct(latencies, 0.5),
        "p99": _pct(latencies, 0.99),
        "imbalance": max(loads) / statistics.mean(loads) if loads else None,
        "moved": sum(1 for names in by_session.values() if len(names) > 1),
        "sessions": len(by_session),
        "failed": len(failed),
        "failed_plain": sum(1 for t in failed if not t.stream),
        "twice": sum(1 for records in served.values() if len(records) > 1),
        "first_error": next((t.error for t in failed), ""),
        "share": {e["name"]: per_engine[e["name"]] for e in stats},
        "note": event_note,
    }
    if scenario.event == "add" and event_time:
        late = stats[-1]["name"]
        # Requests sent after the engine was added: those in flight then could not have gone to it.
        after = [r for t in driver.turns if t.start >= event_time for r in served.get(t.rid, [])[:1]]
        tokens = sum(r[2] + r[4] for r in after)
        row["new_share"] = sum(r[2] + r[4] for r in after if r[0] == late) / tokens if tokens else 0.0
        before: dict[str, set[str]] = defaultdict(set)
        later: dict[str, set[str]] = defaultdict(set)
        for t in driver.turns:
            for name, done, *_ in served.get(t.rid, [])[:1]:
                (before if done < event_time else later)[t.session].add(name)
        existing = [s for s in before if s in later]
        row["existing"] = len(existing)
        row["existing_moved"] = sum(1 for s in existing if later[s] - before[s])
    return row


# --- the report --------------------------------------------------------------------------------------


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rows if r.get(key) is not None]
            out[key] = statistics.median(values) if values else None
    out["runs"] = len(rows)
    return out


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render(summary: dict[str, dict[str, dict[str, Any]]], checks: list[dict[str, Any]]) -> str:
    lines = []
    for name, rows in summary.items():
        lines.append(f"\n{name}: {SCENARIOS[name].about}")
        head = f"  {'target':28} {'hit %':>6} {'turns/s':>8} {'p50 s':>6} {'p99 s':>6} {'imbal':>6}"
        head += f" {'moved':>7} {'failed':>7} {'twice':>5} {'cpu ms':>6}"
        if SCENARIOS[name].event == "add":
            head += f" {'new %':>6} {'exist moved':>11}"
        lines.append(head)
        for target, r in rows.items():
            line = (
                f"  {target:28} {_f(100 * r['hit'], '6.1f')} {_f(r['turns_s'], '8.1f')} {_f(r['p50'], '6.2f')}"
                f" {_f(r['p99'], '6.2f')} {_f(r['imbalance'], '6.2f')} {r['moved']:>3.0f}/{r['sessions']:<3.0f}"
                f" {r['failed']:>3.0f}/{r['failed_plain']:<3.0f} {r['twice']:>5.0f} {_f(r.get('cpu_ms'), '6.2f')}"
            )
            if "new_share" in r:
                line += f" {_f(100 * r['new_share'], '6.1f')} {r['existing_moved']:>5.0f}/{r['existing']:<5.0f}"
            if r.get("note"):
                line += f"  ({r['note']})"
            lines.append(line)
    lines.append(
        "\n  hit: cached/prompt tokens; imbal: max/mean tokens per engine; moved: sessions served by 2+ engines;"
        "\n  failed: failed turns (all/non-streamed); twice: requests completed by 2 engines; new %: the"
        "\n  added engine's share of the tokens of requests sent after it was added; exist moved: sessions from"
        "\n  before that moved; cpu ms: the router's own CPU time per completed turn (all its processes)"
    )
    if checks:
        lines.append("\nchecks (issue #14, against the best baseline of each scenario):")
        for c in checks:
            lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['scenario']:12} {c['target']:20} {c['what']}")
    return "\n".join(lines)


def is_baseline(target: str) -> bool:
    return target in BUILTIN or target.startswith("vllm-router:")


def goal_checks(summary: dict[str, dict[str, dict[str, Any]]], engines: int) -> list[dict[str, Any]]:
    checks = []
    for name, rows in summary.items():
        baselines = {t: r for t, r in rows.items() if is_baseline(t)}
        sticky = {t: r for t, r in baselines.items() if t in STICKY_BASELINES}
        best = max(baselines.values(), key=lambda r: r["turns_s"]) if baselines else None
        for target, r in rows.items():
            if is_baseline(target):
                continue

            def check(ok: bool, what: str, target: str = target, scenario: str = name) -> None:
                checks.append({"scenario": scenario, "target": target, "ok": bool(ok), "what": what})

            if name in ("balanced", "gpu-prefill") and best is not None:
                if sticky:
                    best_hit = max(s["hit"] for s in sticky.values())
                    check(
                        r["hit"] >= best_hit - 0.01,
                        f"hit {100 * r['hit']:.1f}% >= best sticky {100 * best_hit:.1f}% - 1",
                    )
                check(
                    r["turns_s"] >= best["turns_s"],
                    f"turns/s {r['turns_s']:.1f} >= best baseline {best['turns_s']:.1f} ({best['target']})",
                )
            elif name == "slow" and best is not None:
                check(
                    r["turns_s"] >= 1.05 * best["turns_s"],
                    f"turns/s {r['turns_s']:.1f} >= 1.05 x {best['turns_s']:.1f} ({best['target']})",
                )
                check(
                    (r["p99"] or 1e9) <= (best["p99"] or 0),
                    f"p99 {_f(r['p99'], '.2f')} s <= {_f(best['p99'], '.2f')} s",
                )
            elif name == "add":
                check(
                    r.get("new_share", 0) >= 0.20,
                    f"new engine serves {100 * r.get('new_share', 0):.1f}% >= 20% of tokens",
                )
                limit = r.get("existing", 0) / engines
                check(
                    r.get("existing_moved", 0) <= limit,
                    f"existing sessions moved {r.get('existing_moved', 0):.0f} <= 1/N of {r.get('existing', 0):.0f}",
                )
            elif name == "kill":
                check(r["failed_plain"] == 0, f"{r['failed_plain']:.0f} failed non-streamed turns == 0")
                check(r["twice"] == 0, f"{r['twice']:.0f} requests completed twice == 0")
    return checks


# --- command line ------------------------------------------------------------------------------------


def _variant(text: str) -> tuple[str, str]:
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise argparse.ArgumentTypeError(f"--variant takes NAME=COMMAND, got {text!r}")
    return name.strip(), command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fleet.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="scenarios:\n" + "\n".join(f"  {s.name:12} {s.about}" for s in SCENARIOS.values()),
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated (default: all)")
    default_targets = ["round-robin", "hash-mod-n", "gymproxy", *(f"vllm-router:{p}" for p in ROUTER_POLICIES)]
    parser.add_argument(
        "--targets",
        default=",".join(default_targets),
        help="round-robin, hash-mod-n, gymproxy, vllm-router:POLICY (skipped when not installed); variants are added",
    )
    parser.add_argument("--variant", action="append", type=_variant, default=[], metavar="NAME=COMMAND",
                        help="one more gymproxy target, started as `COMMAND serve ...` (absolute paths)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="passed to every gymproxy")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=96)
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=4.0, help="unmeasured seconds first (caches fill)")
    parser.add_argument("--event-at", type=float, default=0.3, help="kill/add at this fraction of the window")
    parser.add_argument("--repeat", type=int, default=1, help="runs per scenario and target; medians are shown")
    parser.add_argument("--cache-blocks", type=int, default=2500, help="16-token blocks of prefix cache per engine")
    parser.add_argument("--step-base", type=float, default=0.012, help="decode step seconds, empty batch")
    parser.add_argument("--step-per-seq", type=float, default=0.0004, help="decode step seconds added per sequence")
    parser.add_argument("--prefill-per-token", type=float, default=0.00005, help="seconds per uncached prompt token")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--check", action="store_true", help="exit 1 if a check fails")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    parser.add_argument("--render", metavar="FILE", help="print the tables of a --json result and run nothing")
    args = parser.parse_args(argv)
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenario_list if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    args.target_list = [t.strip() for t in args.targets.split(",") if t.strip()] + [n for n, _ in args.variant]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        report = json.loads(Path(args.render).read_text())
        print(render(report["summary"], report["checks"]))
        return 1 if args.check and not all(c["ok"] for c in report["checks"]) else 0
    skipped = []
    targets = []
    for target in args.target_list:
        if target.startswith("vllm-router:"):
            if router_binary() is None:
                skipped.append(f"{target}: vllm-router is not installed (pip install vllm-router)")
                continue
            if target.split(":", 1)[1] not in ROUTER_POLICIES + ("random",):
                skipped.append(f"{target}: unknown policy")
                continue
        elif target not in BUILTIN and target != "gymproxy" and target not in dict(args.variant):
            raise SystemExit(f"unknown target {target}")
        targets.append(target)
    for line in skipped:
        print(f"skipped {line}", file=sys.stderr)
    os.environ.setdefault("GYMPROXY_PIN_SECRET", "fleetbench")  # every gymproxy signs pins with one key
    log_dir = Path(tempfile.mkdtemp(prefix="fleetbench-"))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: defaultdict(list) for s in args.scenario_list}
    for name in args.scenario_list:
        for rep in range(args.repeat):
            order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
            for target in order:
                row = asyncio.run(run_once(args, SCENARIOS[name], target, rep, log_dir))
                runs[name][target].append(row)
                print(
                    f"# {name} {target} run {rep + 1}: {row['turns']} turns, hit {100 * row['hit']:.1f}%,"
                    f" failed {row['failed']}",
                    file=sys.stderr,
                    flush=True,
                )
    summary = {s: {t: median_row(runs[s][t]) for t in targets if runs[s][t]} for s in args.scenario_list}
    checks = goal_checks(summary, args.engines)
    if args.json:
        print(json.dumps({"summary": summary, "checks": checks, "skipped": skipped, "runs": runs}, indent=1))
    else:
        print(f"fleet: {args.engines} engines, {args.sessions} sessions, {args.duration:g} s measured after "
              f"{args.warmup:g} s, {args.repeat} run(s) each (median); logs in {log_dir}")  # fmt: skip
        print(render(summary, checks))
    return 1 if args.check and not all(c["ok"] for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
