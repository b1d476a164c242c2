"""Drafting with a model: a small Llama-family model, or the target's own first N layers, runs
ahead greedily inside the drafter, with a paged KV pool and block allocation of its own (the
scheduler's block ids are the executor's and mean nothing here).

Per sequence (one session per Propose stream):
  token_ids     the accepted tokens t[0..L)
  block_ids     blocks of the drafter's pool
  num_computed  how many leading positions hold K/V of t in those blocks
  fed_drafts    the drafts whose K/V the last proposal wrote at positions L, L+1, ...

A proposal of k tokens is k forwards, each over every sequence of the step (varlen batching,
the same AttentionMetadata the executor's model runner builds):
  forward 0  positions [min(num_computed, L-1), L) of t: a prompt for a new sequence, the
             tokens accepted since the last proposal otherwise. Position L-1 is recomputed when
             it is cached already, because its logits were not kept. argmax at L-1 = d_1.
  forward i  (1 <= i < k) one token per sequence: d_i at position L+i-1; argmax = d_{i+1}.

The K/V of d_1..d_{k-1} (positions L..L+k-2) is speculative. When accepted tokens a_1..a_m
arrive, position L+j holds exactly what recomputation would write iff a_1..a_{j+1} equal
d_1..d_{j+1} (a position's K/V depends on its own token and those before it). So num_computed
advances over that common prefix only; the slots past it are not trusted and the next
forward 0 overwrites them. Nothing needs clearing: attention reads a sequence's slots up to
its context length, all of which a forward has written for the current tokens.

A sequence whose blocks cannot be allocated (the pool is full) gets an empty draft for that
step and keeps what it has; speculation is an optimisation and must never fail a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import structlog
import torch

from services.drafter.config import DraftModelSettings, check_num_speculative_tokens
from services.drafter.proposer import DraftMethod, Proposer, ProposerInfo, ProposerSession
from services.runtime.device import resolve_device, resolve_dtype
from services.runtime.step_inputs import pack_rows
from services.runtime.kv_cache import KVCache, cuda_kv_budget, num_blocks_for_budget
from services.runtime.model.attention.registry import get_attention_backend, resolve_backend_name
from services.runtime.model.config import ModelConfig
from services.runtime.model.families import model_class
from services.runtime.model.llama import LlamaForCausalLM
from services.runtime.model.weights import load_checkpoint

_log = structlog.get_logger("tokenmill.drafter")

CUDA_KV_SHARE = 0.1
"""On CUDA without --num-blocks, the draft's pool takes this share of the device memory left
after its weights: it shares the device with the executor, which sizes its pool from what is
free when it starts."""


def load_draft_model(settings: DraftModelSettings, backend, device: torch.device, dtype: torch.dtype
                     ) -> LlamaForCausalLM:
    """The draft: the checkpoint's first ``draft_layers`` layers (all when 0) plus its final norm
    and head. The whole checkpoint is read and checked as usual, then the later layers dropped."""
    full = ModelConfig.from_model_dir(settings.draft_model)
    num_layers = settings.draft_layers or full.num_layers
    if num_layers > full.num_layers:
        raise ValueError(f"draft_layers {settings.draft_layers} exceeds the draft model's "
                         f"num_hidden_layers {full.num_layers} ({settings.draft_model})")
    if settings.target_model:
        target_vocab = ModelConfig.from_model_dir(settings.target_model).vocab_size
        if target_vocab != full.vocab_size:
            raise ValueError(
                f"draft_model {settings.draft_model} has vocab_size {full.vocab_size} but target_model "
                f"{settings.target_model} has {target_vocab}: a draft must share the target's vocabulary")
    weights = load_checkpoint(settings.draft_model, full, dtype)
    for name in [n for n in weights if n.startswith("model.layers.") and int(n.split(".")[2]) >= num_layers]:
        del weights[name]
    config = replace(full, num_layers=num_layers, layer_windows=full.layer_windows[:num_layers])
    return model_class(config)(config, weights, backend, device)  # the draft's own family (families.py)


class BlockPool:
    """Free block ids of the drafter's KV pool. Only the drafter's worker thread touches it."""

    __slots__ = ("num_blocks", "_free")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: ids 0, 1, ... first

    def take(self, n: int) -> list[int] | None:
        """n blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken

    def give_back(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    @property
    def num_free(self) -> int:
        return len(self._free)


class DraftModelProposer(Proposer):
    """The loaded draft model, its KV pool and free blocks, shared by every Propose stream."""

    runs_model = True

    def __init__(self, settings: DraftModelSettings, num_speculative_tokens: int) -> None:
        settings.validate()
        check_num_speculative_tokens(num_speculative_tokens)
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.backend_name = resolve_backend_name(settings.attention_backend, self.device)
        backend = get_attention_backend(self.backend_name, self.device)
        self.dtype = resolve_dtype(settings.dtype, ModelConfig.from_model_dir(settings.draft_model), self.device)
        self.model = load_draft_model(settings, backend, self.device, self.dtype)
        self.model_config = self.model.config
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = self.model_config.max_model_len
        self.block_size = settings.block_size
        self.num_speculative_tokens = num_speculative_tokens
        num_blocks = settings.num_blocks or self._blocks_for_budget()
        self.kv_cache = KVCache.allocate(self.model_config, num_blocks, self.block_size, self.dtype, self.device)
        self.pool = BlockPool(num_blocks)
        _log.info("draft_model_loaded", model=settings.draft_model, layers=self.model_config.num_layers,
                  device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                  attention_backend=self.backend_name, kv_blocks=num_blocks, block_size=self.block_size)

    def _blocks_for_budget(self) -> int:
        budget = self.settings.kv_cache_bytes
        if self.device.type == "cuda":
            budget = min(budget, int(cuda_kv_budget(self.device, 1.0) * CUDA_KV_SHARE))
        return num_blocks_for_budget(self.model_config, self.block_size, self.dtype, budget)

    def new_session(self) -> DraftModelSession:
        return DraftModelSession(self)

    def info(self) -> ProposerInfo:
        return ProposerInfo(DraftMethod.DRAFT_MODEL, self.num_speculative_tokens,
                            draft_model_path=str(Path(self.settings.draft_model)), vocab_size=self.vocab_size)

    # ------------------------------------------------------------------ one batched forward
    def greedy_step(self, rows: list[tuple[_DraftSequence, int, list[int]]]) -> list[int]:
        """Write K/V of each row's tokens (placed from position ``start``) and return the argmax
        after each row's last token. rows: (sequence, start, tokens), its blocks allocated."""
        ids, pos, meta, cu = pack_rows([(tokens, start, seq.block_ids) for seq, start, tokens in rows],
                                       self.block_size, self.device)
        num_seqs, num_tokens = len(rows), cu[-1]
        hidden = self.model(ids, pos, self.kv_cache.layers, meta)
        if num_tokens > num_seqs:  # else every row is one token: its own last
            hidden = hidden[torch.tensor(cu[1:], device=self.device) - 1]
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()


class _DraftSequence:
    __slots__ = ("token_ids", "block_ids", "num_computed", "fed_drafts")

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.block_ids: list[int] = []
        self.num_computed = 0
        self.fed_drafts: list[int] = []


class DraftModelSession(ProposerSession):
    """One Propose stream's sequences over the shared draft model and pool."""

    __slots__ = ("proposer", "_seqs", "num_pool_full")

    def __init__(self, proposer: DraftModelProposer) -> None:
        self.proposer = proposer
        self._seqs: dict[int, _DraftSequence] = {}
        self.num_pool_full = 0
        """Drafts skipped because the pool had no blocks for them (logged the first time)."""

    def _check_tokens(self, seq_id: int, token_ids: Sequence[int]) -> None:
        # The embedding would index out of range with them; a target with another vocabulary
        # shows up here at the latest.
        vocab = self.proposer.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"sequence {seq_id}: token id {bad} is outside the draft model's vocabulary "
                             f"[0, {vocab})")

    def open(self, seq_id: int, token_ids: Sequence[int]) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id} is already open")
        self._check_tokens(seq_id, token_ids)
        self._seqs[seq_id] = _DraftSequence(list(token_ids))

    def append(self, seq_id: int, token_ids: Sequence[int]) -> None:
        seq = self._get(seq_id)
        self._check_tokens(seq_id, token_ids)
        if seq.num_computed == len(seq.token_ids):
            # Keep the speculative K/V of the drafts that were accepted as they were (docstring).
            fed = seq.fed_drafts
            match = 0
            while match < min(len(fed), len(token_ids)) and fed[match] == token_ids[match]:
                match += 1
            seq.num_computed += match
        seq.fed_drafts = []
        seq.token_ids.extend(token_ids)

    def close(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.proposer.pool.give_back(seq.block_ids)

    def close_all(self) -> None:
        for seq_id in list(self._seqs):
            self.close(seq_id)

    def num_computed(self, seq_id: int) -> int:
        """Leading positions of the sequence whose draft K/V is valid (for tests and logs)."""
        return self._get(seq_id).num_computed

    def num_blocks(self, seq_id: int) -> int:
        return len(self._get(seq_id).block_ids)

    @torch.inference_mode()
    def propose_batch(self, seq_ids: Sequence[int], num_tokens: int | None = None) -> list[list[int]]:
        proposer = self.proposer
        k = proposer.num_speculative_tokens if num_tokens is None else min(num_tokens, proposer.num_speculative_tokens)
        drafts: list[list[int]] = [[] for _ in seq_ids]
        batch: list[tuple[int, _DraftSequence, int]] = []  # (index in seq_ids, sequence, its k)
        seqs = [self._get(seq_id) for seq_id in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence is named twice in one proposal")
        for index, seq in enumerate(seqs):
            length = len(seq.token_ids)
            # Drafts land at positions length .. length+k-1, all inside the model's context.
            seq_k = min(k, proposer.max_model_len - length)
            if length == 0 or seq_k <= 0 or not self._reserve(seq, length + seq_k - 1):
                continue
            batch.append((index, seq, seq_k))
        if not batch:
            return drafts
        rows = []
        for _, seq, _ in batch:
            start = min(seq.num_computed, len(seq.token_ids) - 1)
            rows.append((seq, start, seq.token_ids[start:]))
        for (index, seq, _), token in zip(batch, proposer.greedy_step(rows)):
            seq.num_computed = len(seq.token_ids)
            seq.fed_drafts = []
            drafts[index].append(token)
        for step in range(1, max(seq_k for _, _, seq_k in batch)):
            active = [(index, seq) for index, seq, seq_k in batch if seq_k > step]
            # d_step goes in at position L + step - 1.
            rows = [(seq, len(seq.token_ids) + step - 1, [drafts[index][-1]]) for index, seq in active]
            for (index, seq), token in zip(active, proposer.greedy_step(rows)):
                seq.fed_drafts.append(drafts[index][-1])
                drafts[index].append(token)
        return drafts

    def _reserve(self, seq: _DraftSequence, num_slots: int) -> bool:
        """Blocks for positions [0, num_slots); all or none."""
        missing = -(-num_slots // self.proposer.block_size) - len(seq.block_ids)
        if missing <= 0:
            return True
        blocks = self.proposer.pool.take(missing)
        if blocks is None:
            if not self.num_pool_full:
                _log.warning("draft_kv_pool_full", blocks_needed=missing, blocks_free=self.proposer.pool.num_free,
                             pool_blocks=self.proposer.pool.num_blocks,
                             hint="sequences get no drafts until others close; raise --kv-cache-bytes")
            self.num_pool_full += 1
            return False
        seq.block_ids += blocks
        return True

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def _get(self, seq_id: int) -> _DraftSequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"seq_id {seq_id} is not open")
        return seq
