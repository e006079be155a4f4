"""Instructions per request of `gymproxy serve`, counted by callgrind: a measure that noise does not move.

CPU time on a shared machine moves by 20% between rounds; the number of instructions a request
costs does not. Each target (gymproxy as installed, and each `--variant`) runs under
`valgrind --tool=callgrind` in front of the canned vLLM (bench/upstream.py, its whole stream in one
write). The script sends `--warmup` requests of a scenario one at a time, zeroes the counters
(`callgrind_control -z`), sends `--requests` more, dumps them (`callgrind_control -d`), and divides.
Every thread counts (capture's store writer too); the load generator and the upstream do not.

    python bench/instructions.py --scenario chat,chat-stream --requests 200 \
        --variant "capture=/path/to/venv/bin/python -m gymproxy --set capture.enabled=true"

A variant's COMMAND is run as `COMMAND serve --port P --upstream URL ...` (more words may follow
`serve`'s options, as above). Under callgrind a request runs about 50 times slower: 200 requests of
a scenario take about a minute. Needs valgrind (Debian's package).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_proxy import SCENARIOS, Scenario, build_bodies, gymproxy_config
from formats import Column, Table, csv_text, markdown
from procs import free_port

BENCH = Path(__file__).resolve().parent
STARTUP_S = 300.0  # gymproxy's imports under callgrind take a while


def wait_http(url: str, timeout: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def send(url: str, body: bytes, count: int, rollouts: bool) -> None:
    """`count` requests, one at a time, each read to its end (a new rollout id every ten)."""
    for i in range(count):
        headers = {"Content-Type": "application/json"}
        if rollouts:
            headers["X-Rollout-ID"] = f"bench-{os.getpid()}-{i // 10}"
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=600) as reply:
            reply.read()
            if reply.status != 200:
                raise RuntimeError(f"{url} answered {reply.status}")


def counted(dump: Path) -> int:
    """The instructions a callgrind dump holds (its `summary:` line)."""
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"{dump} has no summary line")


def measure(
    name: str, command: list[str], scenario: Scenario, args: argparse.Namespace, upstream: str, work: Path
) -> float:
    """Instructions per request of `scenario` on one target."""
    port = free_port()
    out = work / f"{name}-{scenario.name}"
    settings = [word for item in args.set for word in ("--set", item)]
    valgrind = [
        "valgrind",
        "--tool=callgrind",
        "--trace-children=yes",
        f"--callgrind-out-file={out}.%p",
        "--dump-instr=no",
    ]
    serve = [*command[:1], *command[1:], "serve", "--port", str(port), "--upstream", upstream, *settings]
    if len(command) > 1 and "serve" in command:  # words after `serve` in a variant's command
        at = command.index("serve")
        serve = [*command[: at + 1], "--port", str(port), "--upstream", upstream, *settings, *command[at + 1 :]]
    log = (work / f"{name}-{scenario.name}.log").open("wb")
    process = subprocess.Popen([*valgrind, *serve], stdout=log, stderr=subprocess.STDOUT, cwd=work)
    try:
        root = f"http://127.0.0.1:{port}"
        wait_http(root + "/health", STARTUP_S, process)
        config = gymproxy_config(args, [upstream])
        body = build_bodies(scenario, args, config).proxy
        url = root + scenario.route
        send(url, body, args.warmup, args.rollouts)
        subprocess.run(["callgrind_control", "-z", str(process.pid)], check=True, capture_output=True)
        send(url, body, args.requests, args.rollouts)
        subprocess.run(["callgrind_control", "-d", str(process.pid)], check=True, capture_output=True)
        dumps = sorted(work.glob(f"{out.name}.{process.pid}.*"), key=lambda p: p.stat().st_mtime)
        if not dumps:
            raise RuntimeError(f"callgrind wrote no dump for {name} (see {log.name})")
        return counted(dumps[-1]) / args.requests
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default="chat,chat-stream", help="comma-separated, from bench_proxy.py's")
    parser.add_argument("--requests", type=int, default=200, help="counted requests per target (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="requests before counting (default 20)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="passed to every target")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="one more target, run as `COMMAND serve ...` (words after `serve` in COMMAND follow its options)",
    )
    parser.add_argument("--rollouts", action="store_true", help="send X-Rollout-ID (a new rollout every ten calls)")
    parser.add_argument("--format", choices=("text", "markdown", "csv", "json"), default="text")
    parser.add_argument("--keep", metavar="DIR", help="keep the callgrind dumps and logs here (for callgrind_annotate)")
    parser.add_argument("--config", help="gymproxy config file (as bench_proxy.py takes it)")
    args = parser.parse_args(argv)
    args.scenario = [name.strip() for name in args.scenario.split(",") if name.strip()]
    unknown = [name for name in args.scenario if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    args.upstream, args.model, args.max_tokens = None, "bench", 0  # what build_bodies reads
    if not any(item.startswith("uses_reasoning_parser=") for item in args.set):
        args.set.append("uses_reasoning_parser=true")  # the canned replies carry reasoning, as bench_proxy.py says
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions.py: needs valgrind and callgrind_control (apt-get install valgrind)", file=sys.stderr)
        return 2
    targets = {"gymproxy": [sys.executable, "-m", "gymproxy"]}
    for item in args.variant:
        name, _, command = item.partition("=")
        targets[name] = shlex.split(command)
    port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, str(BENCH / "upstream.py"), "--port", str(port), "--chunk-interval", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results: dict[str, dict[str, float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="gymproxy-instructions-") as tmp:
            work = Path(args.keep or tmp)
            work.mkdir(parents=True, exist_ok=True)
            for scenario in (SCENARIOS[name] for name in args.scenario):
                for name, command in targets.items():
                    print(f"{scenario.name} {name}: counting {args.requests} requests ...", file=sys.stderr, flush=True)
                    per = measure(name, command, scenario, args, f"http://127.0.0.1:{port}/v1", work)
                    results.setdefault(scenario.name, {})[name] = per
    finally:
        upstream.terminate()
        upstream.wait()
    if args.format == "json":
        print(json.dumps(results, indent=1))
        return 0
    columns = [Column("target", "target"), Column("instructions", "instructions per request", 0)]
    tables = [
        Table(scenario, f"{scenario}: {SCENARIOS[scenario].about}", columns, [[n, v] for n, v in per.items()])
        for scenario, per in results.items()
    ]
    if args.format == "markdown":
        print(markdown(tables))
    elif args.format == "csv":
        print(csv_text(tables, "scenario"))
    else:
        for table in tables:
            print(table.title)
            for name, value in table.rows:
                print(f"  {name:16} {value:14,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
