"""Reading the packed parallel arrays of the per-step stream messages.

Every per-step message (StepRequest, DetokenizeRequest, ProposeRequest) carries a batch as
parallel arrays: ids, a count per id, and the items of all ids concatenated. A malformed
message names the field that disagrees, so the sender's bug is found from the status alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from services.common.errors import InvalidArgumentError


def split_packed(
    ids: Sequence[int],
    counts: Sequence[int],
    flat: Sequence[int],
    *,
    ids_field: str,
    counts_field: str,
    flat_field: str,
) -> list[tuple[int, list[int]]]:
    """Pair each id with its slice of `flat`; raises InvalidArgumentError naming the bad field.

    ids, counts: parallel (one count per id). flat: the items of all ids, concatenated in ids
    order, so len(flat) == sum(counts). Ids must be unique.
    """
    ids = list(ids)
    counts = list(counts)
    flat = list(flat)
    if len(counts) != len(ids):
        raise InvalidArgumentError(
            f"{counts_field} has {len(counts)} entries; expected {len(ids)} (one per entry of {ids_field})"
        )
    if counts and min(counts) < 0:
        raise InvalidArgumentError(f"{counts_field} has a negative entry {min(counts)}")
    total = sum(counts)
    if total != len(flat):
        raise InvalidArgumentError(f"{flat_field} has {len(flat)} entries but {counts_field} sums to {total}")
    if len(set(ids)) != len(ids):
        duplicate = next(i for n, i in enumerate(ids) if i in ids[:n])
        raise InvalidArgumentError(f"{ids_field} lists {duplicate} more than once")
    ends = accumulate(counts)
    return [(i, flat[end - count : end]) for i, count, end in zip(ids, counts, ends)]
