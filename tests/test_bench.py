"""Smoke tests of bench/: each script runs for about a second and reports sane numbers.

Timings are never asserted (the machine may be busy): only that every target answered every
scenario correctly, that throughput is positive and that CPU figures are present. Each script's
--quick preset is checked (bench_convert's runs whole; the others' with tiny durations), and so
are the output formats (CSV read back with the csv module, markdown tables' shape, JSON), the
progress lines (stderr only, none with --quiet) and --plot (a PNG, when matplotlib is installed).
The simulated engines' pause modes and fleet.py's weight-sync bookkeeping are tested in process.
"""

from __future__ import annotations

import asyncio
import csv
import importlib.util
import io
import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

BENCH = Path(__file__).resolve().parent.parent / "bench"

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="CPU accounting reads /proc")


def run(
    script: str, *args: str, timeout: float = 120, status: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout, cwd=BENCH,
        env=env,
    )  # fmt: skip
    assert result.returncode == status, f"{script} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
NO_MATPLOTLIB = "matplotlib is not installed (the plot extra): --plot is untested here"
PROGRESS = re.compile(r"\[ *\d+%\] .+ \(\d+:\d\d elapsed(, ~\d+:\d\d left)?\)")


def progress_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The progress lines, from stderr; none may reach stdout, where the results go."""
    assert "elapsed" not in result.stdout
    return [line for line in result.stderr.splitlines() if PROGRESS.fullmatch(line)]


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in `text` as rows of cells, after checking its shape: a header, a separator, rows
    of as many cells."""
    tables: list[list[list[str]]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            block = list(itertools.takewhile(lambda row: row.startswith("|"), lines[i:]))
            cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in block]
            assert len(cells) >= 3, block  # a header, the separator, a row at least
            assert all(re.fullmatch(r"---:?", c) for c in cells[1]), block[1]
            assert all(len(row) == len(cells[0]) for row in cells), block
            tables.append([cells[0], *cells[2:]])
    return tables


def read_csv(text: str) -> list[dict[str, str]]:
    rows = list(csv.reader(io.StringIO(text)))
    assert rows and all(len(row) == len(rows[0]) for row in rows), text
    return [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]


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


@pytest.fixture(scope="module")
def proxy_quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """bench_proxy.py --quick with tiny durations, as CSV, the JSON document written beside, a picture if it can."""
    out = tmp_path_factory.mktemp("bench_proxy")
    picture = ["--plot", str(out / "cost.png")] if MATPLOTLIB else []
    result = run(
        "bench_proxy.py", "--quick", "--duration", "0.3", "--warmup", "0.1", "--rounds", "1", "--concurrency", "2",
        "--chunk-interval", "0.0005", "--format", "csv", "--output", str(out / "doc.json"), *picture,
    )  # fmt: skip
    return result, out


def test_bench_proxy_quick_runs_its_scenarios_and_writes_csv(
    proxy_quick: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, out = proxy_quick
    rows = read_csv(result.stdout)
    quick = {"responses", "responses-multiturn", "chat-stream"}
    assert {(row["scenario"], row["target"]) for row in rows} == {(s, t) for s in quick for t in ("floor", "gymproxy")}
    for row in rows:
        assert row["errors"] == "0" and float(row["rps"]) > 0 and float(row["cpu_us"]) >= 0, row
        assert (row["chunks"] == "200.00") == (row["scenario"] == "chat-stream"), row  # stream columns, streams only
    assert json.loads((out / "doc.json").read_text())["meta"]["duration"] == 0.3  # given options beat the preset
    lines = progress_lines(result)
    assert len(lines) == 6 and all(" round 1/1 " in line for line in lines), result.stderr


def test_bench_proxy_prints_markdown_tables_and_its_goals(proxy_quick: tuple[Any, Path]) -> None:
    document = json.loads((proxy_quick[1] / "doc.json").read_text())
    text = _bench_module("bench_proxy").render_markdown(document["meta"], document["summary"])
    tables = markdown_tables(text)
    assert [len(table) - 1 for table in tables] == [2, 2, 2, 3]  # floor and gymproxy in each scenario; 3 goals
    assert tables[0][0][:6] == ["target", "req/s", "p50 ms", "p99 ms", "CPU µs/req", "x floor"]
    assert "+µs/chunk" in tables[2][0] and tables[3][0][0] == "goal (gymproxy)"
    assert "issue" not in text and "#6" not in text


@pytest.mark.skipif(not MATPLOTLIB, reason=NO_MATPLOTLIB)
def test_bench_proxy_plot_writes_a_png(proxy_quick: tuple[Any, Path]) -> None:
    assert (proxy_quick[1] / "cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install_it_before_running(tmp_path: Path) -> None:
    hidden = tmp_path / "hide" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(hidden.parent)}
    picture = tmp_path / "fleet.png"
    result = run("fleet.py", "--render", str(tmp_path / "none.json"), "--plot", str(picture), status=2, env=env)
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "pip install matplotlib" in result.stderr, result.stderr
    assert not picture.exists()


@pytest.mark.parametrize(
    ("script", "given", "key", "value"),
    [
        ("bench_proxy", ["--rounds", "5"], "rounds", 5),
        ("fleet", ["--duration", "9"], "duration", 9.0),
        ("soak", ["--sessions", "7"], "sessions", 7),
        ("bench_convert", ["--repeat", "9"], "repeat", 9),
    ],
)
def test_quick_is_a_preset_that_options_on_the_line_override(
    script: str, given: list[str], key: str, value: Any
) -> None:
    module = _bench_module(script)
    quick, default = module.parse_args(["--quick"]), module.parse_args([])
    assert {name: getattr(quick, name) for name in module.QUICK} == module.QUICK
    assert {name: getattr(default, name) for name in module.QUICK} != module.QUICK  # the default is the long run
    mine = module.parse_args(["--quick", *given])
    assert getattr(mine, key) == value and getattr(default, key) != value
    assert {name: getattr(mine, name) for name in module.QUICK if name != key} == {
        name: v for name, v in module.QUICK.items() if name != key
    }


def test_bench_convert_reports_every_operation() -> None:
    result = run("bench_convert.py", "--min-time", "0.002", "--repeat", "2", "--json", "--quiet")
    report = json.loads(result.stdout)
    rows = [value for section in report["sections"].values() for value in section.values()]
    assert len(report["sections"]) == 6
    assert rows and all(value["median"] > 0 and value["best"] > 0 for value in rows)
    assert result.stderr == ""  # --quiet: no progress


def test_bench_convert_quick_runs_whole_and_writes_csv() -> None:
    result = run("bench_convert.py", "--quick", "--format", "csv")  # ~6 s of CPU
    rows = read_csv(result.stdout)
    assert list(rows[0]) == ["section", "operation", "median_us", "best_us"]
    assert len(rows) == 29 and len({row["section"] for row in rows}) == 6
    assert all(float(row["median_us"]) > 0 and float(row["best_us"]) > 0 for row in rows)
    lines = progress_lines(result)
    assert len(lines) == 6 and lines[-1].startswith("[100%] stream-chunk"), result.stderr


def test_bench_convert_prints_a_markdown_table_per_section() -> None:
    result = run("bench_convert.py", "--min-time", "0.002", "--repeat", "2", "--format", "markdown")
    tables = markdown_tables(result.stdout)
    assert len(tables) == 6
    assert all(table[0] == ["operation", "median µs", "best µs"] for table in tables)
    assert sum(len(table) - 1 for table in tables) == 29
    assert all(float(row[1]) > 0 for table in tables for row in table[1:])


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


@pytest.fixture(scope="module")
def fleet_kill() -> subprocess.CompletedProcess[str]:
    return run(
        # 8 sessions: with 4, hash-mod-n (whose sessions on e1 fail from the kill on) sometimes completed no
        # turn at all in the window on a loaded machine.
        "fleet.py", "--scenarios", "kill", "--targets", "hash-mod-n,gymproxy", "--engines", "2", "--sessions", "8",
        "--duration", "2", "--warmup", "0.5", "--event-at", "0.2", "--json",
        timeout=180,  # ~12 s alone; once ~130 s on a machine loaded by other test runs
    )  # fmt: skip


def test_fleet_simulates_a_kill_against_a_baseline_and_gymproxy(fleet_kill: subprocess.CompletedProcess[str]) -> None:
    result = fleet_kill
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
    lines = progress_lines(result)
    assert [line.split("]")[0] for line in lines] == ["[ 50%", "[100%"], result.stderr
    assert "kill hash-mod-n run 1/1: " in result.stderr and "kill gymproxy run 1/1: " in result.stderr


def test_fleet_renders_a_result_as_csv_and_markdown(
    fleet_kill: subprocess.CompletedProcess[str], tmp_path: Path
) -> None:
    saved = tmp_path / "kill.json"
    saved.write_text(fleet_kill.stdout)
    rows = read_csv(run("fleet.py", "--render", str(saved), "--format", "csv").stdout)
    assert [(row["scenario"], row["target"]) for row in rows] == [("kill", "hash-mod-n"), ("kill", "gymproxy")]
    report = json.loads(fleet_kill.stdout)["summary"]["kill"]
    for row in rows:  # the figures of the JSON, in the units of the text table
        assert float(row["hit_pct"]) == pytest.approx(100 * report[row["target"]]["hit"], abs=1e-3), row
        assert float(row["turns_s"]) == pytest.approx(report[row["target"]]["turns_s"], abs=1e-3), row
    text = run("fleet.py", "--render", str(saved), "--format", "markdown").stdout
    kill, checks = markdown_tables(text)
    assert kill[0][:3] == ["target", "hit %", "turns/s"] and [row[0] for row in kill[1:]] == ["hash-mod-n", "gymproxy"]
    assert checks[0] == ["scenario", "target", "result", "check"] and len(checks) == 3
    assert "issue" not in text


@pytest.mark.skipif(not MATPLOTLIB, reason=NO_MATPLOTLIB)
def test_fleet_plot_writes_a_png(fleet_kill: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    saved, picture = tmp_path / "kill.json", tmp_path / "fleet.png"
    saved.write_text(fleet_kill.stdout)
    run("fleet.py", "--render", str(saved), "--plot", str(picture), "--quiet")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_soak_quick_with_a_tiny_load_reports_csv_and_its_phases() -> None:
    result = run("soak.py", "--quick", "--sessions", "20", "--requests", "100", "--abandon", "5", "--format", "csv")
    (row,) = read_csv(result.stdout)
    assert (row["sessions"], row["requests"], row["abandoned"], row["errors"], row["result"]) == (
        "20", "100", "5", "0", "PASS",
    ), row  # fmt: skip
    assert int(row["ok"]) >= 20 * 3 + 100, row
    phases = [line.split("] ")[1].split(":")[0] for line in progress_lines(result)]
    assert phases == ["warm-up and baseline", "sessions", "requests", "abandon", "open fds back near the baseline"]


def test_formats_escape_cells_and_merge_columns_into_one_csv() -> None:
    formats = _bench_module("formats")
    column = formats.Column
    one = formats.Table("a", "A", [column("name", "name"), column("x", "x", 1)], [["p|q", 1.234], ["r", None]])
    two = formats.Table("b", "B", [column("name", "name"), column("y", "y", 0)], [["s", 7.0]])
    (first,) = markdown_tables(formats.markdown([one]))
    assert first == [["name", "x"], ["p\\|q", "1.2"], ["r", "-"]]
    assert formats.csv_text([one, two], "group").splitlines() == [
        "group,name,x,y", "a,p|q,1.234,", "a,r,,", "b,s,,7.00",
    ]  # fmt: skip


def _bench_module(name: str) -> Any:
    """bench/NAME.py as a module (bench/ is not a package), loaded once."""
    if f"bench_{name}" not in sys.modules:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        path = list(sys.path)
        sys.path.insert(0, str(BENCH))  # its imports of its neighbours (procs, formats, ...)
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path[:] = path  # bench/ first for the module's own imports only
    return sys.modules[f"bench_{name}"]


@pytest.fixture
async def sim_engine(unused_tcp_port: int) -> Any:
    """One simulated engine on a real port, 2 ms decode steps, weight version "1"; `.url` is its root."""
    engine = _bench_module("sim_engines").Engine(
        0, {"port": unused_tcp_port, "step_base": 0.002, "step_per_seq": 0.0, "weight_version": "1"}
    )
    await engine.start()
    engine.url = f"http://127.0.0.1:{unused_tcp_port}"
    yield engine
    engine.kill()


def _chat(rid: str, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    messages = [{"role": "user", "content": rid}]
    return {"model": "sim", "messages": messages, "max_tokens": max_tokens, "request_id": rid, "stream": stream}


async def _until(condition: Callable[[], object], what: str) -> None:
    """Until `condition()` holds (the engine's own state, looked at between its steps), at most 5 s."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"not within 5 s: {what}")


async def _read_stream(reply: aiohttp.ClientResponse) -> tuple[int, str | None, bool]:
    """Words, the last finish_reason and whether [DONE] came, of a chat stream."""
    words, finish, done = 0, None, False
    async for line in reply.content:
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b"data: "):
            for choice in json.loads(line[6:])["choices"]:
                words += bool(choice["delta"].get("content"))
                finish = choice["finish_reason"] or finish
    return words, finish, done


async def _first_word(reply: aiohttp.ClientResponse) -> None:
    """Reads a chat stream up to its first generated word: the sequence is decoding."""
    async for line in reply.content:
        if line.startswith(b"data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
            return


def _spans(engine: Any, rid: str) -> list[tuple[str, list[str]]]:
    """(finish, versions) of every reply the engine ended under `rid`."""
    return [(finish, [v for v, _ in spans]) for r, finish, _tokens, spans in engine.replies if r == rid]


async def test_sim_engine_abort_pause_cuts_every_request_and_answers_503_until_resume(sim_engine: Any) -> None:
    url = sim_engine.url
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with http.post(f"{url}/v1/chat/completions", json=_chat("s", 5000, stream=True)) as stream:
            await _first_word(stream)
            plain = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json=_chat("p", 5000)))
            await _until(lambda: any(seq.rid == "p" for seq in sim_engine.running), "p admitted")
            async with http.post(f"{url}/pause?mode=abort") as reply:
                assert (reply.status, await reply.json()) == (200, {"status": "paused"})
            words, finish, done = await _read_stream(stream)
            assert finish == "abort" and done and words < 5000
        async with await plain as reply:
            choice = (await reply.json())["choices"][0]
            assert reply.status == 200 and choice["finish_reason"] == "abort"
            assert len(choice["message"]["content"].split()) < 5000
        async with http.post(f"{url}/v1/chat/completions", json=_chat("late", 5)) as reply:
            assert reply.status == 503
            assert (await reply.json())["error"]["message"] == "Generation is paused. Please retry after it resumes."
        async with http.get(f"{url}/is_paused") as reply:
            assert await reply.json() == {"is_paused": True}
        async with http.post(f"{url}/update_weight_version", json={"new_version": "2"}) as reply:
            assert await reply.json() == {"success": True, "new_version": "2"}
        async with http.get(f"{url}/weight_info") as reply:
            assert await reply.json() == {"weight_version": "2"}
        async with http.post(f"{url}/resume") as reply:
            assert await reply.json() == {"status": "resumed"}
        async with http.post(f"{url}/v1/chat/completions", json=_chat("after", 5)) as reply:
            assert (await reply.json())["choices"][0]["finish_reason"] == "stop"
    assert _spans(sim_engine, "s") == [("abort", ["1"])]
    assert _spans(sim_engine, "p") in ([("abort", [])], [("abort", ["1"])])  # cut in its prefill, or later
    assert _spans(sim_engine, "after") == [("stop", ["2"])]
    assert not sim_engine.cache  # an abort pause clears the prefix cache (clear_cache defaults to true)


async def test_sim_engine_keep_pause_freezes_requests_and_queues_new_ones(sim_engine: Any) -> None:
    url = sim_engine.url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.post(f"{url}/v1/chat/completions", json=_chat("s", 60, stream=True)) as stream:
            await _first_word(stream)
            async with http.post(f"{url}/pause?mode=keep") as reply:
                assert reply.status == 200
            (frozen,) = sim_engine.running
            await _until(lambda: not sim_engine.wake.is_set(), "the scheduler froze")  # after the step under way
            before = frozen.generated
            queued = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json=_chat("q", 5)))
            await asyncio.sleep(0.1)  # 50 decode steps' time: none may run
            assert frozen.generated == before < 60 and not queued.done()
            async with http.post(f"{url}/update_weight_version", json={"new_version": "2"}) as reply:
                assert reply.status == 200
            async with http.post(f"{url}/resume") as reply:
                assert reply.status == 200
            assert await _read_stream(stream) == (60 - 1, "stop", True)  # the first word was read above
        async with await queued as reply:
            assert (await reply.json())["choices"][0]["finish_reason"] == "stop"
    assert _spans(sim_engine, "s") == [("stop", ["1", "2"])]  # sampled by both versions
    assert _spans(sim_engine, "q") == [("stop", ["2"])]


async def test_sim_engine_wait_pause_answers_once_requests_finished(sim_engine: Any) -> None:
    url = sim_engine.url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        plain = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json=_chat("p", 50)))
        await _until(lambda: sim_engine.running, "p admitted")
        pause = asyncio.ensure_future(http.post(f"{url}/pause?mode=wait"))
        await _until(lambda: sim_engine.paused, "the pause began")
        async with http.post(f"{url}/v1/chat/completions", json=_chat("late", 5)) as reply:
            assert reply.status == 503  # vLLM >= 0.33 under wait too
        async with await pause as reply:
            assert reply.status == 200
            assert plain.done()  # /pause answered only once the request in flight had finished
        async with await plain as reply:
            assert (await reply.json())["choices"][0]["finish_reason"] == "stop"
        async with http.post(f"{url}/pause?mode=sideways") as reply:
            assert reply.status == 400 and "error" in await reply.json()


async def test_sim_engine_can_queue_requests_while_paused_as_vllm_032(unused_tcp_port: int) -> None:
    engine = _bench_module("sim_engines").Engine(
        0, {"port": unused_tcp_port, "step_base": 0.002, "paused_requests": "queue"}
    )
    await engine.start()
    url = f"http://127.0.0.1:{unused_tcp_port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.post(f"{url}/pause?mode=abort") as reply:
                assert reply.status == 200
            queued = asyncio.ensure_future(http.post(f"{url}/v1/chat/completions", json=_chat("q", 5)))
            await _until(lambda: engine.queued, "q queued")
            async with http.post(f"{url}/resume") as reply:
                assert reply.status == 200
            async with await queued as reply:
                assert (await reply.json())["choices"][0]["finish_reason"] == "stop"
        assert [(f, v) for _, f, _, v in engine.replies] == [("stop", [("default", 0)])]  # vLLM's first version
    finally:
        engine.kill()


def test_fleet_weight_sync_measures_stale_mixed_aborted_and_unstamped_replies() -> None:
    fleet = _bench_module("fleet")
    driver = fleet.Driver(fleet.Workload(sessions=1), ["http://127.0.0.1:1"], "t")
    update = fleet.Update("1", pause_at=10.0, paused_at=10.1, resumed_at=10.6)
    turn = fleet.Turn
    driver.turns = [
        turn("s0", "user", "old", start=9.0, end=11.0, ok=True, status=200, finish="stop", stamp="0,1"),
        turn("s1", "user", "late", start=10.7, end=11.5, ok=True, status=200, finish="stop", stamp="1"),
        turn("s2", "user", "new", start=10.8, end=11.6, ok=True, status=200, finish="stop"),
        turn("s3", "user", "cut", start=9.5, end=10.0, status=200, finish="abort", stamp="0"),
        turn("s3", "user", "refused", start=10.2, end=10.3, status=503),
    ]
    stats = [
        {
            "name": "e0",
            "replies": [
                ["old", "stop", 40, [["0", 0], ["1", 12]]],  # frozen across the update (keep): mixed, not stale
                ["late", "abort", 3, [["0", 0]]],  # an earlier attempt under the same id, cut
                ["late", "stop", 40, [["0", 0]]],  # started after the resume, sampled by "0": stale
                ["new", "stop", 40, [["1", 0]]],
                ["cut", "abort", 7, [["0", 0]]],
            ],
        }
    ]
    row = fleet.measure_sync("gymproxy", driver, stats, (9.8, 12.0), [update])
    assert (row["stale"], row["mixed"], row["aborted"], row["unmatched"]) == (1, 1, 1, 0)
    assert (row["unstamped"], row["replied"]) == (1, 4)  # "new" has no X-Weight-Version
    assert row["misstamped"] == 1  # "late" says "1", the engine sampled it with "0"
    assert row["updates"] == 1 and row["pause_s"] == pytest.approx(0.6)
    assert fleet.measure_sync("no-proxy", driver, stats, (9.8, 12.0), [update])["unstamped"] is None


def test_fleet_weight_sync_pauses_the_engines_under_the_baseline_and_gymproxy() -> None:
    result = run(
        "fleet.py", "--scenarios", "weight-sync", "--targets", "no-proxy,gymproxy", "--sync-through", "engines",
        "--engines", "2", "--sessions", "4", "--duration", "2", "--warmup", "0.5", "--sync-every", "0.8",
        "--sync-transfer", "0.2", "--json",
        timeout=180,
    )  # fmt: skip
    report = json.loads(result.stdout)
    rows = report["summary"]["weight-sync"]
    assert set(rows) == {"no-proxy", "gymproxy"}
    for target, row in rows.items():
        assert row["updates"] >= 2 and row["update_errors"] == 0, (target, row["first_update_error"])
        assert row["turns"] > 0 and row["unmatched"] == 0 and row["stale"] == 0, target
        assert row["pause_s"] >= 0.2, target  # the transfer alone takes that
    # Paused in abort mode, the engines cut and refused the clients' turns, which the clients retried.
    assert rows["no-proxy"]["failed"] > 0 and rows["no-proxy"]["unstamped"] is None
    assert rows["gymproxy"]["unstamped"] is not None and rows["gymproxy"]["cpu_ms"] > 0
    assert {c["target"] for c in report["checks"]} == {"gymproxy"}
    assert any("X-Weight-Version" in c["what"] for c in report["checks"])


async def test_fleet_trainer_takes_gymproxy_through_an_update_by_its_fleet_routes(aiohttp_server: Any) -> None:
    calls: list[tuple[str, str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        body = await request.text()
        calls.append((request.method, request.path_qs, json.loads(body) if body else None))
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    server = await aiohttp_server(app)
    proxy = str(server.make_url("")).rstrip("/")
    unreachable = "http://127.0.0.1:9"  # the engines: through gymproxy, the trainer never calls them
    trainer = _bench_module("fleet").Trainer("keep", 1.0, 0.0, [unreachable], proxy)
    async with aiohttp.ClientSession() as http:
        await trainer.update(http, "3")
    assert calls == [
        ("POST", "/fleet/pause?mode=keep", None),
        ("POST", "/fleet/broadcast/update_weight_version", {"new_version": "3"}),
        ("POST", "/fleet/resume", None),
    ]
    (update,) = trainer.updates
    assert update.errors == [] and update.pause_at <= update.paused_at <= update.resumed_at
