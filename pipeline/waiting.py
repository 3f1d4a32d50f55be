"""How much of a prompt partition waits, as the workers' group tells it in its committed
offsets' metadata: ``next=<the position read to>;waiting=<prompts read, not started>``.

A worker commits the low watermark of its unfinished turns (so a new owner re-reads
each of them), which a long turn holds back; what waits is the partition's end less the
position read to, and the prompts read but not yet started. Admission counts that
(``gateway.fleet``): a running turn is not waiting work.
"""

from __future__ import annotations

import re

_TOLD = re.compile(r"next=(\d{1,19});waiting=(\d{1,9})")


def describe(next_offset: int, waiting: int) -> str:
    return f"next={next_offset};waiting={waiting}"


def parse(metadata: str) -> tuple[int, int] | None:
    """``(next, waiting)`` from a commit's metadata (None: it says neither, as commits of
    workers from before it did)."""
    found = _TOLD.fullmatch(metadata or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def waiting(committed: int, end: int, metadata: str) -> tuple[int, int]:
    """``(prompts waiting, prompts past waiting)`` in one partition: from what its
    commit told, or, without it, counting every prompt past the committed offset."""
    told = parse(metadata)
    if told is None:
        return max(end - committed, 0), committed
    position, taken = told
    return max(end - position, 0) + taken, position - taken
