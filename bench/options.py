"""The command-line options every bench script shares: --quick, --format (--json), --quiet and --plot."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

import plot
from formats import FORMATS


def add(parser: argparse.ArgumentParser, *, quick: str, pictures: str | None = None) -> None:
    """Add the shared options; `quick` says what the preset runs and how long it takes, `pictures` what --plot draws."""
    out = parser.add_argument_group("output")
    out.add_argument("--quick", action="store_true", help=f"a short run that still compares: {quick}; options given too override it")  # fmt: skip
    out.add_argument("--format", choices=FORMATS, default="text",
                     help="text (default: the tables), markdown (tables to paste), csv (one flat table) or json (everything)")  # fmt: skip
    out.add_argument("--json", dest="format", action="store_const", const="json", help="the same as --format json")
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    if pictures is not None:
        out.add_argument(
            "--plot", metavar="FILE.png", help=f"also draw a picture into FILE (needs matplotlib): {pictures}"
        )


def parse(parser: argparse.ArgumentParser, argv: list[str] | None, quick: Mapping[str, Any]) -> argparse.Namespace:
    """Parse `argv`; with --quick, `quick` replaces the defaults first, so options given on the line still win.

    A --plot that cannot be drawn (no matplotlib, not a picture name) ends here, in one line, exit 2."""
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**quick)
    args = parser.parse_args(argv)
    reason = plot.problem(args.plot) if getattr(args, "plot", None) else None
    if reason is not None:
        print(f"{parser.prog}: {reason}", file=sys.stderr)
        raise SystemExit(2)
    return args
