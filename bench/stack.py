"""What the benchmarks need of the local stack besides load: a log the store has caught up
with, so no projector's catching up is measured as the load's cost."""

from __future__ import annotations

import time

from pipeline.kafka import GroupStatus
from pipeline.topics import CONVERSATION_TOPICS
from projections.settings import ProjectorSettings


def wait_projected(bootstrap: str, timeout: float = 600.0) -> None:
    """Until the projector has caught up with the log (whatever earlier runs wrote)."""
    status = GroupStatus(bootstrap, ProjectorSettings().group)
    deadline = time.monotonic() + timeout
    try:
        while True:
            behind = sum(max(end - at, 0) for topic in CONVERSATION_TOPICS
                         for at, end in status.per_partition(topic).values())
            if behind < 100:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the projector is still {behind} records behind")
            print(f"waiting for the projector to catch up: {behind:,} records behind",
                  flush=True)
            time.sleep(2)
    finally:
        status.close()
