"""Unique ids for responses, items and requests, without a system call each.

Each process draws 64 random bits once; an id is those bits followed by a counter, so ids are
unique across processes and restarts (with overwhelming probability) and cost a string format.
They are identifiers, not secrets.
"""

from __future__ import annotations

import itertools
import secrets

_PROCESS = secrets.token_hex(8)
_COUNTER = itertools.count(int.from_bytes(secrets.token_bytes(4), "big"))


def hex32() -> str:
    """32 lowercase hex digits, unique per call."""
    return f"{_PROCESS}{next(_COUNTER) & 0xFFFFFFFFFFFFFFFF:016x}"


def new_id(prefix: str) -> str:
    """`<prefix>_<32 hex>`, the shape OpenAI and NeMo Gym ids have (resp_, msg_, rs_, call_)."""
    return f"{prefix}_{_PROCESS}{next(_COUNTER) & 0xFFFFFFFFFFFFFFFF:016x}"  # hex32(), one call less
