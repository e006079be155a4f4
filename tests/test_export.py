"""`gymproxy rollouts export` (rollouts/export.py), run as the installed command against each store:
one JSON line per rollout that is exactly what `GET /v1/rollouts/{id}` answers, `--frozen-only`,
Parquet rows that hold the same, a file only its owner reads, bounded memory, and each failure one
line with its exit status and no file left behind."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gymproxy.rollouts.record import Call
from gymproxy.rollouts.trajectory import CALL_FIELDS
from gymproxy.testing.fake_vllm import FakeVLLM

from .faults import start_proxy
from .stores import Backend, RedisServer

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
# The command's own peak (VmHWM: ru_maxrss would carry the forking test process's over exec).
PEAK = """
import sys
from gymproxy.cli import main
try:
    main(sys.argv[1:])
finally:
    peak = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
    print("peak-rss-kb", peak, file=sys.stderr)
"""


def export(*args: str, env: dict[str, str] = ENV) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gymproxy", "rollouts", "export", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


async def test_each_line_is_what_get_answers_and_frozen_only_keeps_the_frozen(
    aiohttp_server: Any, tmp_path: Path, backend: Backend
) -> None:
    fake = FakeVLLM()
    fake.url = str((await aiohttp_server(fake.app)).make_url("/v1"))
    capture = {"enabled": True, "store": backend.url("export"), "record_requests": True}
    url, proxy = await start_proxy(aiohttp_server, fake.url, capture=capture, health={"interval": 60})
    expected: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        for rid in ("b-1", "a-2", "c-3"):
            history: list[dict[str, Any]] = []
            for turn in range(3):
                history.append({"role": "user", "content": f"turn {turn} of {rid}"})
                async with session.post(
                    f"{url}/ng-rollout/{rid}/v1/chat/completions", json={"model": "m", "messages": history}
                ) as r:
                    assert r.status == 200
                    history.append((await r.json())["choices"][0]["message"])
        async with session.post(f"{url}/v1/rollouts/a-2/freeze") as r:
            assert r.status == 200
        for rid in ("a-2", "b-1", "c-3"):
            async with session.get(f"{url}/v1/rollouts/{rid}") as r:
                expected[rid] = await r.json()
    await proxy.capture.close()
    out = tmp_path / "rollouts.jsonl"
    done = export("--store", backend.url("export"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"exported 3 rollouts (9 calls) to {out}"
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [expected["a-2"], expected["b-1"], expected["c-3"]]  # by id
    assert all(line["calls"][0]["request"]["messages"] for line in lines)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    frozen = tmp_path / "frozen.jsonl"
    assert export("--store", backend.url("export"), "--out", str(frozen), "--frozen-only").returncode == 0
    assert [json.loads(line) for line in frozen.read_text().splitlines()] == [expected["a-2"]]

    pytest.importorskip("pyarrow", reason="pyarrow is not installed: the Parquet export is not tested")
    import pyarrow.parquet as pq

    table = tmp_path / "rollouts.parquet"
    done = export("--store", backend.url("export"), "--out", str(table))
    assert done.returncode == 0, done.stderr
    rows = pq.read_table(table).to_pylist()
    assert [row["rollout_id"] for row in rows] == ["a-2", "b-1", "c-3"]
    assert set(rows[0]["calls"][0]) == set(CALL_FIELDS)
    for row, line in zip(rows, lines, strict=True):
        assert row["segments"] == line["segments"] and row["breaks"] == line["breaks"]
        for call, sent in zip(row["calls"], line["calls"], strict=True):
            assert json.loads(call.pop("usage")) == sent.pop("usage")
            assert json.loads(call.pop("request")) == sent.pop("request")
            assert call == sent
        assert {k: v for k, v in row.items() if k not in ("calls", "segments", "breaks")} == {
            k: v for k, v in line.items() if k not in ("calls", "segments", "breaks")
        }


async def test_a_large_store_is_exported_in_bounded_memory(tmp_path: Path) -> None:
    """4,000 calls of 500-token prompts (some 40 MB of JSON): the export holds one rollout at a time."""
    from gymproxy.rollouts.sqlite_store import SQLiteStore
    from gymproxy.rollouts.store import Bounds

    url = f"sqlite:///{tmp_path / 'big.db'}"
    store = SQLiteStore(url, Bounds())
    await store.start()
    for r in range(200):
        for i in range(20):
            call = Call(
                rollout_id=f"r{r:03}",
                call_id=f"r{r}-{i}",
                route="chat",
                started=time.time(),
                outcome="ok",
                prompt_token_ids=[(r * 7919 + i * 104729 + t) % 150_000 for t in range(500)],
                generation_token_ids=list(range(50)),
                generation_log_probs=[-0.25] * 50,
            )
            store.begin(call)
            store.end(call)
        await store.freeze(f"r{r:03}")  # a barrier: the queue stays small
    await store.close()
    out = tmp_path / "big.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", PEAK, "rollouts", "export", "--store", url, "--out", str(out)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    peak_mb = int(done.stderr.split("peak-rss-kb")[-1]) / 1024
    size_mb = out.stat().st_size / 1e6
    assert size_mb > 30 and len(out.read_bytes().splitlines()) == 200
    assert peak_mb < 120, f"the export peaked at {peak_mb:.0f} MB for {size_mb:.0f} MB of output"


async def test_each_failure_is_one_line_with_its_status_and_leaves_no_file(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    missing = export("--store", f"sqlite:///{tmp_path / 'none.db'}", "--out", str(out))
    assert missing.returncode == 2 and "no such file" in missing.stderr and len(missing.stderr.splitlines()) == 1
    unknown = export("--store", "postgres://user:secret@db/x", "--out", str(out))
    assert unknown.returncode == 2 and "secret" not in unknown.stderr and len(unknown.stderr.splitlines()) == 1
    down = RedisServer(tmp_path / "redis")  # never started
    gone = export("--store", f"redis://:secret@127.0.0.1:{down.port}/0", "--out", str(out))
    assert gone.returncode == 1 and "unreachable" in gone.stderr and "secret" not in gone.stderr
    assert len(gone.stderr.splitlines()) == 1
    shim = tmp_path / "shim" / "pyarrow"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('no pyarrow here')\n")
    (tmp_path / "s.db").touch()
    env = {**ENV, "PYTHONPATH": f"{shim.parent}{os.pathsep}{ENV['PYTHONPATH']}"}
    parquet = export("--store", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "o.parquet"), env=env)
    assert parquet.returncode == 2 and "pip install pyarrow" in parquet.stderr
    assert len(parquet.stderr.splitlines()) == 1
    usage = export("--store", "sqlite:///x.db")
    assert usage.returncode == 2 and "--out" in usage.stderr
    assert not list(tmp_path.glob("*.jsonl*")) and not list(tmp_path.glob("*.parquet*"))
