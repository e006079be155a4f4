"""`gymproxy rollouts export --store URL --out FILE [--frozen-only]`: what a training job reads.

Every rollout of a store (or its frozen ones), each as `GET /v1/rollouts/{id}` answers it (its
calls, and its segments with token_ids, loss_mask and logprobs, and breaks: `trajectory.view`):
one JSON line each, or one Parquet row each when FILE ends in `.parquet` (needs pyarrow; a call's
`usage` and `request` are JSON text there). The store is read one rollout at a time and the file
written as it goes (Parquet a row group at a time), so memory is bounded by the largest rollout,
not by the store. The file is written beside FILE and renamed into place when whole, readable by
its owner only (it holds every prompt). The store is only read: nothing is evicted or changed.

Exit status: 0 written; 1 the store could not be read or the file written (no file is left);
2 the command cannot run as given (a store URL it cannot open, `.parquet` without pyarrow).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any, Final

import msgspec

from .store import Bounds, Store, StoreError, open_store
from .trajectory import view

PAGE: Final = 100  # rollouts listed at once
ROW_GROUP_CALLS: Final = 20_000  # calls buffered before a Parquet row group is written
READER: Final = Bounds(max_age_s=math.inf, max_bytes=1 << 62)  # evicts nothing

_ENCODE: Final = msgspec.json.Encoder().encode


class Usage(Exception):
    """The command cannot run as given (exit 2)."""


def export(url: str, out: str, *, frozen_only: bool = False) -> int:
    """Run the export; its exit status (see the module docstring). Errors are one line on stderr."""
    logging.getLogger("gymproxy").setLevel(logging.ERROR)  # a store's own warnings are not the reader's
    try:
        rollouts, calls = asyncio.run(_export(url, Path(out), frozen_only))
    except Usage as exc:
        print(f"gymproxy rollouts export: {exc}", file=sys.stderr)
        return 2
    except (StoreError, OSError) as exc:
        print(f"gymproxy rollouts export: {exc}", file=sys.stderr)
        return 1
    print(f"exported {rollouts} rollouts ({calls} calls) to {out}")
    return 0


async def _export(url: str, out: Path, frozen_only: bool) -> tuple[int, int]:
    parquet = out.suffix == ".parquet"
    if parquet:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise Usage(f"--out {out}: Parquet needs pyarrow (pip install pyarrow), or write .jsonl") from None
    if url.startswith("sqlite://"):
        from .sqlite_store import path_of

        if not path_of(url).is_file():
            raise Usage(f"--store {url}: no such file (a store is made by gymproxy serve with capture.enabled)")
    try:
        store = open_store(url, READER)
        await store.start()
    except StoreError as exc:
        raise Usage(f"--store: {exc}") from None
    partial = out.with_name(out.name + ".partial")
    rollouts = calls = 0
    try:
        partial.unlink(missing_ok=True)  # made anew: owner-only
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as file:
            write = _ParquetWriter(file) if parquet else _JSONLinesWriter(file)
            async for rollout in _rollouts(store, frozen_only):
                write.add(rollout)
                rollouts += 1
                calls += len(rollout["calls"])
            write.close()
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
        await store.close()
    return rollouts, calls


async def _rollouts(store: Store, frozen_only: bool) -> AsyncIterator[dict[str, Any]]:
    """Each rollout's view, in id order, read one at a time."""
    after = None
    while True:
        page = await store.list(after=after, limit=PAGE, state="frozen" if frozen_only else None)
        for summary in page:
            rollout = await store.get(summary.rollout_id)
            if rollout is not None:  # deleted or evicted since it was listed
                yield view(rollout)
        if len(page) < PAGE:
            return
        after = page[-1].rollout_id


class _JSONLinesWriter:
    def __init__(self, file: IO[bytes]) -> None:
        self.file = file

    def add(self, rollout: dict[str, Any]) -> None:
        self.file.write(_ENCODE(rollout) + b"\n")

    def close(self) -> None:
        pass


class _ParquetWriter:
    """Rows buffered up to `ROW_GROUP_CALLS` calls, then written as one row group."""

    def __init__(self, file: IO[bytes]) -> None:
        import pyarrow.parquet as pq

        self.schema = _schema()
        self.writer = pq.ParquetWriter(file, self.schema)
        self.rows: list[dict[str, Any]] = []
        self.calls = 0

    def add(self, rollout: dict[str, Any]) -> None:
        row = msgspec.to_builtins(rollout)
        for call in row["calls"]:
            for field in ("usage", "request"):  # free-form JSON objects: kept as JSON text
                if call[field] is not None:
                    call[field] = _ENCODE(call[field]).decode()
        self.rows.append(row)
        self.calls += len(row["calls"])
        if self.calls >= ROW_GROUP_CALLS:
            self._flush()

    def close(self) -> None:
        self._flush()
        self.writer.close()

    def _flush(self) -> None:
        import pyarrow as pa

        if self.rows:
            self.writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
        self.rows, self.calls = [], 0


def _schema() -> Any:
    """One row a rollout: the fields of `trajectory.view`, typed."""
    import pyarrow as pa

    ids, floats = pa.list_(pa.int64()), pa.list_(pa.float64())
    call = pa.struct(
        [
            ("rollout_id", pa.string()),
            ("call_id", pa.string()),
            ("route", pa.string()),
            ("stream", pa.bool_()),
            ("started", pa.float64()),
            ("seq", pa.int64()),
            ("ended", pa.float64()),
            ("outcome", pa.string()),
            ("upstream", pa.string()),
            ("weight_version", pa.string()),
            ("finish_reason", pa.string()),
            ("error", pa.string()),
            ("usage", pa.string()),
            ("prompt_token_ids", ids),
            ("generation_token_ids", ids),
            ("generation_log_probs", floats),
            ("request", pa.string()),
        ]
    )
    segment = pa.struct([("calls", ids), ("token_ids", ids), ("loss_mask", pa.list_(pa.int8())), ("logprobs", floats)])
    brk = pa.struct(
        [
            ("call", pa.int64()),
            ("segment", pa.int64()),
            ("position", pa.int64()),
            ("expected_start", pa.int64()),
            ("expected", ids),
            ("got", ids),
        ]
    )
    return pa.schema(
        [
            ("rollout_id", pa.string()),
            ("object", pa.string()),
            ("state", pa.string()),
            ("complete", pa.bool_()),
            ("created", pa.float64()),
            ("updated", pa.float64()),
            ("frozen_at", pa.float64()),
            ("refused", pa.int64()),
            ("calls", pa.list_(call)),
            ("segments", pa.list_(segment)),
            ("breaks", pa.list_(brk)),
        ]
    )
