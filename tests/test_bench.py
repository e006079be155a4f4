"""Smoke tests of bench/: each script runs for about a second and reports sane numbers.

Timings are never asserted (the machine may be busy): only that every target answered every
scenario correctly, that throughput is positive and that CPU figures are present.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="CPU accounting reads /proc")


def run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout, cwd=BENCH
    )
    assert result.returncode == 0, f"{script} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def test_data_matches_its_generator() -> None:
    assert "up to date" in run("make_data.py", "--check").stdout


def test_bench_proxy_runs_every_scenario_against_every_target() -> None:
    result = run(
        "bench_proxy.py", "--duration", "0.5", "--warmup", "0.1", "--rounds", "1", "--concurrency", "2",
        "--chunk-interval", "0.0005", "--json",
    )  # fmt: skip
    report = json.loads(result.stdout)
    summary = report["summary"]
    assert set(summary) == {"chat", "chat-tool", "responses", "responses-multiturn", "chat-stream", "responses-stream"}
    for scenario, rows in summary.items():
        assert set(rows) == {"upstream", "floor", "gymproxy"}, scenario
        for target, row in rows.items():
            where = f"{scenario}/{target}"
            assert row["errors"] == 0, (where, row["first_error"])
            assert row["rps"] > 0, where
            assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"], where
            assert row["cpu_us"] is not None and row["cpu_us"] >= 0, where
        assert rows["gymproxy"]["x_floor"] is not None, scenario
        if scenario.endswith("-stream"):
            assert rows["floor"]["chunks"] == 200, scenario  # the canned stream, relayed frame for frame
            assert rows["gymproxy"]["ttfb_p50_ms"] > 0, scenario
            assert rows["gymproxy"]["extra_us_per_chunk"] is not None, scenario
    # Each target's reply was checked before the load: the Responses conversion really ran.
    assert "function_call" in report["checks"]["responses"]["gymproxy"]
    assert "reasoning" in report["checks"]["responses-stream"]["gymproxy"]
    assert {goal["goal"] for goal in report["goals"]} >= {"/v1/responses CPU per request vs floor"}


def test_bench_proxy_prints_tables() -> None:
    result = run(
        "bench_proxy.py", "--scenario", "responses", "--targets", "floor,gymproxy", "--duration", "0.3",
        "--warmup", "0.1", "--rounds", "1", "--concurrency", "2",
    )  # fmt: skip
    assert "CPU µs/req" in result.stdout
    assert "gymproxy" in result.stdout and "x floor" in result.stdout


def test_bench_convert_reports_every_operation() -> None:
    report = json.loads(run("bench_convert.py", "--min-time", "0.002", "--repeat", "2", "--json").stdout)
    rows = [value for section in report["sections"].values() for value in section.values()]
    assert len(report["sections"]) == 6
    assert rows and all(value["median"] > 0 and value["best"] > 0 for value in rows)


def test_stages_times_each_stage_inside_the_server(tmp_path: Path) -> None:
    out = tmp_path / "stages.txt"
    result = run(
        "bench_proxy.py", "--scenario", "responses-multiturn,responses-stream,chat-stream", "--targets", "gymproxy",
        "--duration", "0.3", "--warmup", "0.1", "--rounds", "1", "--concurrency", "2", "--chunk-interval", "0.0005",
        "--variant", f"stages={sys.executable} {BENCH / 'stages.py'} --out {out}",
    )  # fmt: skip
    assert "stages" in result.stdout
    table = out.read_text()
    rows = [line.rsplit(None, 3) for line in table.splitlines()[2:]]  # after the title and the header
    calls = {name.strip(): int(count) for name, count, _per_call, _total in rows}
    for stage in (
        "decode the Responses request",
        "to_chat_body",
        "to_response",
        "stream: decode a chunk",
        "stream: ResponsesStream.feed",
        "stream: check a chat chunk",
        "stream: write to the client",
    ):
        assert calls.get(stage, 0) > 0, (stage, table)


def test_fleet_simulates_a_kill_against_a_baseline_and_gymproxy() -> None:
    result = run(
        "fleet.py", "--scenarios", "kill", "--targets", "hash-mod-n,gymproxy", "--engines", "2", "--sessions", "4",
        "--duration", "2", "--warmup", "0.5", "--event-at", "0.2", "--json",
        timeout=180,  # ~12 s alone; once ~130 s on a machine loaded by other test runs
    )  # fmt: skip
    report = json.loads(result.stdout)
    rows = report["summary"]["kill"]
    assert set(rows) == {"hash-mod-n", "gymproxy"}
    for target, row in rows.items():
        assert row["turns"] > 0 and row["turns_s"] > 0, target
        assert 0 < row["hit"] <= 1, target  # both are sticky: later turns find their prefix cached
        assert 0 < row["p50"] <= row["p99"], target
        assert row["twice"] == 0, target
        assert row["cpu_ms"] > 0, target  # the router's own CPU time was read
        if row["share"]["e1"] > 0:  # e1 served sessions before it was killed: they failed or moved
            assert row["failed"] > 0 or row["moved"] > 0, (target, row)
    assert {c["target"] for c in report["checks"]} == {"gymproxy"}
    assert any("completed twice" in c["what"] for c in report["checks"])
