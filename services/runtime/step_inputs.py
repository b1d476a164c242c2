"""A varlen step's tensors from Python lists, in two host-to-device copies.

The executor's model runner and the drafter's draft model build the same inputs: int64
[input ids | positions | slots] and int32 [context lens | query starts | block table], every
tensor the model reads a view into one of the two. Both describe a step as rows (``pack_rows``):
a sequence's new tokens, the position of the first, and its block table.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from services.runtime.model.attention.base import AttentionMetadata


def pack_rows(
    rows: Sequence[tuple[Sequence[int], int, list[int]]], block_size: int, device: torch.device,
    num_kv_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """``pack_step_inputs`` of rows (tokens, position of the first, block ids): each row's
    tokens take the positions from there on, and their slots through its block table.

    ``num_kv_groups`` > 1: each block table interleaves that many groups' blocks
    (services/common/kv_groups.py); the metadata is group 0's, with every group's in ``groups``."""
    if num_kv_groups > 1:
        return _pack_grouped_rows(rows, block_size, device, num_kv_groups)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    bs = block_size
    for tokens, start, blocks in rows:
        n = len(tokens)
        input_ids += tokens
        if n == 1:  # a decode row: scalars, no ranges
            positions.append(start)
            slots.append(blocks[start // bs] * bs + start % bs)
        else:
            positions += range(start, start + n)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        query_lens.append(n)
        context_lens.append(start + n)
    return pack_step_inputs(input_ids, positions, slots, query_lens, context_lens,
                            [blocks for _, _, blocks in rows], block_size, device)


def pack_step_inputs(
    input_ids: list[int],
    positions: list[int],
    slots: list[int],
    query_lens: list[int],
    context_lens: list[int],
    block_tables: Sequence[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """(input ids [T], positions [T], metadata, query starts as a host list [B + 1])."""
    num_seqs, num_tokens = len(query_lens), len(input_ids)
    width = max(len(table) for table in block_tables)
    cu = [0, *accumulate(query_lens)]
    ints = context_lens + cu  # [B] context lens, [B + 1] query starts, then the [B, width] table
    for table in block_tables:
        ints += table
        ints += [0] * (width - len(table))
    longs = torch.tensor(input_ids + positions + slots, dtype=torch.int64, device=device)  # [3T]
    ints_dev = torch.tensor(ints, dtype=torch.int32, device=device)
    ids, positions_dev, meta = unpack_step_inputs(longs, ints_dev, query_lens, context_lens, width, block_size)
    return ids, positions_dev, meta, cu


def unpack_step_inputs(
    longs: torch.Tensor,
    ints: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    width: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Views of the packed layout: ``longs`` [3T] (input ids, positions, slots) and ``ints`` int32
    ([B] context lens, [B + 1] query starts, the [B, width] block table), with the host copies of
    the lengths. Shared by the runner and the tensor-parallel ranks that receive it."""
    num_seqs, num_tokens = len(query_lens), longs.numel() // 3
    meta = AttentionMetadata(
        slot_mapping=longs[2 * num_tokens :],
        block_tables=ints[2 * num_seqs + 1 :].view(num_seqs, width),
        context_lens=ints[:num_seqs],
        query_start_loc=ints[num_seqs : 2 * num_seqs + 1],
        query_lens_cpu=query_lens,
        context_lens_cpu=context_lens,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        block_size=block_size,
    )
    return longs[:num_tokens], longs[num_tokens : 2 * num_tokens], meta


def _pack_grouped_rows(
    rows: Sequence[tuple[Sequence[int], int, list[int]]], block_size: int, device: torch.device, n: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """pack_rows per KV group: one upload per group's slots and tables; the ids, positions and
    lengths are group 0's, shared."""
    ids, positions, meta, cu = pack_rows([(t, start, blocks[0::n]) for t, start, blocks in rows], block_size, device)
    metas = [meta]
    for k in range(1, n):
        slots: list[int] = []
        tables = []
        for tokens, start, blocks in rows:
            table = blocks[k::n]
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + len(tokens))]
            tables.append(table)
        width = max(len(table) for table in tables)
        flat = [b for table in tables for b in (*table, *[0] * (width - len(table)))]
        metas.append(AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(flat, dtype=torch.int32, device=device).view(len(rows), width),
            context_lens=meta.context_lens, query_start_loc=meta.query_start_loc,
            query_lens_cpu=meta.query_lens_cpu, context_lens_cpu=meta.context_lens_cpu,
            max_query_len=meta.max_query_len, max_context_len=meta.max_context_len, block_size=block_size,
        ))
    meta.groups = tuple(metas)
    return ids, positions, meta, cu
