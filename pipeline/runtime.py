"""The Python runtime of a long-running service: its garbage collector.

CPython's cyclic collector runs a young collection every 700 new container objects and
an older one every tenth of those; each older collection walks every tracked object
left from start-up (modules, pydantic's validators, vLLM), millions of them, although
none of them will ever be garbage. Profiled under streaming load (perf), that walk was
a tenth of the gateway's CPU. A service that has finished starting freezes what it has
(``gc.freeze``: never walked again) and collects less often: garbage in cycles still
goes, later and in larger batches.
"""

from __future__ import annotations

import gc

# Container objects allocated (net) between young collections; CPython's default is 700.
YOUNG_THRESHOLD = 50_000


def settle() -> None:
    """Call once a service has started: its objects so far are kept out of collections."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
