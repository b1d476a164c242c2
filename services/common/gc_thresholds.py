"""How often a service process runs Python's cyclic garbage collector.

Python collects its youngest generation once 700 more container objects have been allocated
than freed since its last collection. A service under load crosses that all the time without
making much garbage: one scheduler step holds a delta, a list and a dict per running request at once, and
grpcio leaves one small reference cycle per accepted call (its method-handler lookup, a closure
whose scope holds the closure). Measured with a ``gc.callbacks`` timer in the scheduler over
the stress suite's two and a half minutes (200 streams, bursts, killed clients): at the default
thresholds it ran 12,269 young, 1,115 middle and 100 full collections, 6.05 s of its ~110 s of
CPU, of which 67 pauses were over 5 ms. With a young threshold of 2,000 and 20 for the older
generations: 658, 30 and 1 collections, 1.37 s, 37 pauses over 5 ms; the garbage collected was
the same (~200,000 objects). A higher threshold saves a little more CPU but each collection then
frees more garbage at once: 5,000 took 0.69 s in 127 collections, 65 of them over 5 ms. See
docs/design.md, "The garbage collector's thresholds".
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
