"""How often a service process runs Python's cyclic garbage collector.

Python collects its youngest generation once 700 more container objects have been allocated
than freed since its last collection. A service under load crosses that all the time without
making much garbage: one scheduler step holds a delta, a list and a dict per running request
at once, and grpcio leaves one small reference cycle per accepted call (its method-handler
lookup, a closure whose scope holds the closure). Over the stress load the scheduler spent
6.05 s in the collector at Python's thresholds and 1.37 s at these, with fewer pauses over
5 ms; a higher young threshold frees more garbage per collection, so its pauses are longer.
The measurements: docs/benchmarks.md, "The garbage collector's thresholds under the stress load".
"""

from __future__ import annotations

import gc

GC_YOUNG_THRESHOLD = 2000
"""Container objects allocated (net) between young-generation collections; Python's is 700."""
GC_OLDER_THRESHOLD = 20
"""Collections of the generation below between collections of the next; Python's is 10."""


def check_gc_young_threshold(young: int) -> None:
    if young < 0:
        raise ValueError(f"gc_young_threshold must be >= 0 (0 = Python's defaults), got {young}")


def set_gc_thresholds(young: int = GC_YOUNG_THRESHOLD) -> None:
    """young > 0: collect the youngest generation every ``young`` net allocations and each older
    one every GC_OLDER_THRESHOLD collections of the one below; 0 leaves Python's thresholds."""
    check_gc_young_threshold(young)
    if young:
        gc.set_threshold(young, GC_OLDER_THRESHOLD, GC_OLDER_THRESHOLD)
