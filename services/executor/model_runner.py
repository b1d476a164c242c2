"""The model runner: turns a StepPlan into tensors, runs one forward, samples, returns a StepResult.

It keeps the state of every running sequence between steps (services/executor/sequences.py),
so a step only carries diffs. Each forward goes to the first of the executor's forward paths
that takes it (services/executor/forward_paths/: decode graphs, the compiled or the fused CPU
step, else eager). Logits never leave it: the result holds sampled ids and, when asked, logprobs.
With ``tensor_parallel_size`` > 1 it is rank 0 (services/executor/tensor_parallel.py): the
model is its shard, and each forward first hands the step's inputs to the other ranks.
"""

from __future__ import annotations

import time

import torch

from services.common.adapters import AdapterInfo
from services.common.step import ExecutorInfo, SequenceOutput, StepPlan, StepResult, TokenLogprobs
from services.executor.config import ExecutorConfig
from services.executor.forward_paths import ForwardPath, PathRuntime, Placement, choose_path, set_up_paths
from services.executor.forward_paths.step import ForwardStep
from services.executor.sequences import PoolLimits, Scheduled, SequenceState, apply_plan
from services.executor.tensor_parallel import start_rank_zero, tensor_parallel_path
from services.runtime.device import resolve_device, resolve_dtype
from services.runtime.kernels.kv_quant import parse_kv_cache_dtype
from services.runtime.kv_blocks import kv_layout
from services.common.kv_groups import KVGroups
from services.runtime.kv_cache import KVCache, bytes_per_block, cuda_kv_budget, model_kv_groups, num_blocks_for_budget
from services.runtime.lora.adapter import AdapterError, LoraAdapter, load_adapter, parse_lora_flag
from services.runtime.lora.batch import LoraBatch
from services.runtime.lora.registry import AdapterRegistry
from services.runtime.lora.stacks import LoraStacks
from services.runtime.model.attention.registry import get_attention_backend, resolve_backend_name
from services.runtime.model.config import ModelConfig, dtype_name
from services.runtime.model.families import load_model, model_class
from services.runtime.model.llama import LlamaForCausalLM
from services.runtime.model.olmoe import OlmoeForCausalLM
from services.runtime.model.qwen3 import Qwen3ForCausalLM
from services.runtime.model.vocab import sampled_vocab_size
from services.runtime.parallel.collectives import STEP_KINDS, AllReduceHooks
from services.runtime.parallel.leader import TensorParallelError, TensorParallelLeader
from services.runtime.parallel.vocab_head import VocabParallelHead
from services.runtime.sampling.batch import SamplingBatch, is_plain_greedy
from services.runtime.sampling.grammar import GrammarMatchers, MaskFuture
from services.runtime.sampling.sampler import Sampler
from services.runtime.sampling.token_mask import token_allowed
from services.runtime.sampling.verify import emitted_tokens


def _prompt_logprob_rows(scheduled: Scheduled, query_starts: list[int]) -> list[tuple[int, range, list[int]]]:
    """(index in ``scheduled``, hidden rows, target token ids) of each sequence that asked for
    prompt logprobs and computes prompt positions this step: position p of its chunk predicts
    prompt token p + 1 (the last prompt position predicts the first output: sampled, not here)."""
    out = []
    for i, (state, n) in enumerate(scheduled):
        if state.sampling.prompt_logprobs is None:
            continue
        first = state.num_computed_tokens
        end = min(first + n, state.prompt_len - 1)  # positions first .. end - 1
        if end > first:
            row = query_starts[i]
            out.append((i, range(row, row + end - first), state.token_ids[first + 1:end + 1]))
    return out


class ModelRunner:
    def __init__(self, config: ExecutorConfig):
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = mc = ModelConfig.from_model_dir(config.model)
        self.dtype = resolve_dtype(config.dtype, mc, self.device)
        self.backend_name = resolve_backend_name(config.attention_backend, self.device)
        self.backend = get_attention_backend(self.backend_name, self.device)
        path = choose_path(config.path_settings(), Placement(self.device.type, self.backend_name))
        self.block_size = config.block_size
        self.max_model_len = _max_model_len(config, mc)
        # The pool's storage: the model's dtype, or int8 / float8_e4m3fn values with scales.
        self.kv_dtype = _kv_storage_dtype(config, self.dtype, self.backend_name, self.device)
        self.parallel: TensorParallelLeader | None = None
        """Rank 0's hold on the other ranks of a tensor-parallel executor (None: one rank)."""
        self.all_reduces: AllReduceHooks | None = None
        """Its all-reduces, timed when asked (benchmarks/tensor_parallel.py)."""
        self.kv_groups = model_kv_groups(mc)
        """Window and full-attention layers in groups of their own blocks (services/common/kv_groups.py)."""
        vocab: list[range] | None = None
        if config.tensor_parallel_size > 1:
            path, vocab = self._start_ranks(path)
        else:
            self._load_one_rank(path)
        self.paths = set_up_paths(path, config.path_settings(), PathRuntime(
            self.model, self.kv_cache.layers, self.device, self.block_size, self.max_model_len,
            scratch_block=self.num_usable_blocks,
            all_reduce=self.parallel.groups.shm if self.parallel is not None else None,
            capture_with=self.parallel.capture if self.parallel is not None else None))
        """The forward paths a step is offered to, in order; eager, the last, takes every step."""
        self._lm_head = self._lm_head_over(vocab)
        self.vocab_size = sampled_vocab_size(config.model, mc.vocab_size)
        """Ids it may sample: the LM head's rows past the tokenizer's ids are masked (vocab.py)."""
        self.sampler = Sampler(seed=config.seed)
        self.grammars = GrammarMatchers(config.model, mc.vocab_size, mc.eos_token_ids)
        self.sequences: dict[int, SequenceState] = {}
        self._limits = PoolLimits(self.num_usable_blocks, self.block_size, self.vocab_size)
        self.adapters = AdapterRegistry(
            lambda: LoraStacks(mc, config.max_loras, config.max_lora_rank, self.device), config.max_loras,
            lambda adapter: load_adapter(adapter.name, adapter.path, mc, config.max_lora_rank,
                                          config.max_lora_file_bytes))
        """The LoRA adapters it serves (services/runtime/lora/); their slots fill at first use."""
        for entry in config.lora:
            self.load_adapter(*parse_lora_flag(entry))

    def _start_ranks(self, path: type[ForwardPath]) -> tuple[type[ForwardPath], list[range] | None]:
        """Rank 0 here and the other ranks started: the model, its pool and the path as tensor
        parallelism runs it; and the rows of each rank's share of a vocab-parallel head."""
        config, mc = self.config, self.model_config
        if self.kv_groups.num_groups > 1:
            # The ranks' pools are one per layer: every layer keeps every block (no window freeing).
            self.kv_groups = KVGroups((tuple(range(mc.num_layers)),), (0,))
        # Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE; Qwen3 and Qwen3-MoE (q/k norms per head, whole on
        # each rank); OLMoE (its q/k norms' sums of squares added over the ranks: olmoe.py).
        if model_class(mc) not in (LlamaForCausalLM, Qwen3ForCausalLM, OlmoeForCausalLM):
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}: tensor parallelism runs the "
                             f"Llama, Qwen3 and OLMoE families' models; {mc.architecture} runs on one rank")
        rank_zero = start_rank_zero(config, mc, self.device, self.dtype, self.backend_name, self.backend,
                                    self.kv_dtype, tensor_parallel_path(path), self.max_model_len)
        self.parallel, self.model = rank_zero.leader, rank_zero.model
        self.all_reduces = rank_zero.hooks
        self.num_usable_blocks, self.kv_cache = rank_zero.num_blocks, rank_zero.kv_cache
        return rank_zero.path, rank_zero.vocab

    def _load_one_rank(self, path: type[ForwardPath]) -> None:
        config, mc = self.config, self.model_config
        self.model = load_model(config.model, self.backend, self.device, self.dtype, mc,
                                prepack_cpu_weights=not path.plain_weights,
                                quant_activations=self._quant_activations())
        self.num_usable_blocks = config.num_blocks or _blocks_for_budget(config, mc, self.kv_dtype, self.device,
                                                                         self.kv_groups)
        # A path's scratch blocks lie past the pool the scheduler is told about.
        self.kv_cache = KVCache.allocate(mc, self.num_usable_blocks + path.scratch_blocks, self.block_size,
                                         self.kv_dtype, self.device, self.kv_groups)

    def _lm_head_over(self, vocab: list[range] | None):
        """[N, D] -> fp32 [N, V]: a path's LM head where it has one (the fused step's, whose rows
        never depend on their batch), else the model's; under tensor parallelism with a
        vocab-parallel head, that over rank 0's share, gathered with the other ranks'."""
        lm_head = next((p.lm_head for p in self.paths if p.lm_head is not None), self.model.compute_logits)
        if vocab is None:
            return lm_head
        head = VocabParallelHead(self.parallel.groups, lm_head, vocab)
        return lambda hidden: self.parallel.collective(lambda: head(hidden))

    # ------------------------------------------------------------------ LoRA adapters
    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Read and check an adapter (AdapterError naming the file and field) and serve it under
        ``name``. Safe beside a running step: only the step thread writes the slots."""
        if self.config.max_loras == 0:
            raise AdapterError(f"adapter {name!r}: this executor serves no adapters (max_loras=0)")
        if self.parallel is not None:
            raise AdapterError(f"adapter {name!r}: adapters run on one rank; this executor has "
                               f"tensor_parallel_size {self.config.tensor_parallel_size}")
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank,
                               self.config.max_lora_file_bytes)
        self.adapters.register(adapter)
        return _adapter_info(adapter)

    def unload_adapter(self, name: str) -> bool:
        return self.adapters.unregister(name)

    def _lora_slots(self, scheduled: Scheduled) -> list[int] | None:
        """The adapter slot of each row of the step (-1: the base model), None when no row has
        one. A sequence whose adapter has no slot (unloaded, files gone) is marked to fail."""
        names = {state.adapter for state, _ in scheduled if state.adapter and state.adapter_error is None}
        if not names:
            return None
        slots, errors = self.adapters.slots_for(names)
        row_slots = []
        for state, _ in scheduled:
            if state.adapter in errors:
                state.adapter_error = errors[state.adapter]
            row_slots.append(slots.get(state.adapter, -1) if state.adapter_error is None else -1)
        return row_slots if any(slot >= 0 for slot in row_slots) else None

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel executor (nothing to do for one rank)."""
        if self.parallel is not None:
            self.parallel.close()

    def _quant_activations(self) -> str:
        """``quant_activations`` resolved for this device (auto: each weight's own choice on a CPU,
        one rank: exact where its kernel exists, int8 where only that one does; none elsewhere)."""
        mode = self.config.quant_activations
        if mode == "int8" and self.device.type != "cpu":
            raise ValueError(f"quant_activations 'int8' runs on the CPU; the model runs on {self.device}")
        if mode != "auto":
            return mode
        return "auto" if self.device.type == "cpu" and self.config.tensor_parallel_size == 1 else "none"

    def info(self) -> ExecutorInfo:
        mc = self.model_config
        layout = kv_layout(mc, self.block_size, self.kv_dtype, self.dtype)
        kv_bytes = self.num_usable_blocks * bytes_per_block(mc, self.block_size, self.kv_dtype, self.kv_groups)
        if self.parallel is not None:
            # All ranks' pools together; a layout of its own, so no peer takes its blocks for its own.
            kv_bytes = sum(self.parallel.kv_bytes)
            layout += f":tensor_parallel={self.parallel.world}"
        return ExecutorInfo(
            num_blocks=self.num_usable_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            attention_backend=self.backend_name,
            model=str(self.config.model),
            architecture=mc.architecture,
            bos_token_id=mc.bos_token_id,
            eos_token_ids=mc.eos_token_ids,
            kv_cache_dtype=dtype_name(self.dtype) if self.config.kv_cache_dtype == "auto" else self.config.kv_cache_dtype,
            kv_cache_bytes=kv_bytes,
            kv_layout=layout,
            kv_group_windows=self.kv_groups.windows,
            max_loras=self.config.max_loras if self.parallel is None else 0,
            adapters=tuple(_adapter_info(adapter) for adapter in self.adapters.known()),
        )

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        scheduled, drafts = apply_plan(self.sequences, plan, self._limits)
        for new in plan.new:
            if new.sampling.grammar:
                state = self.sequences[new.seq_id]
                try:
                    state.matcher = self.grammars.matcher(new.sampling.grammar, state.token_ids[state.prompt_len:])
                except ValueError as exc:
                    # That request's failure alone: it runs unconstrained until the scheduler,
                    # told by its output, ends it with this error (its tokens are not used).
                    state.grammar_error = str(exc)
        if not scheduled:
            return StepResult(plan.step_id, [])
        if self.parallel is None:
            outputs = self._run_step(scheduled, drafts)
            self._run_more_steps(plan, scheduled, outputs)
        else:
            try:
                outputs = self._run_step(scheduled, drafts)
                self._run_more_steps(plan, scheduled, outputs)
            except TensorParallelError:
                raise
            except Exception as exc:  # the other ranks may be inside this step: the group is lost
                raise self.parallel.step_failed(exc) from exc
        _report_grammar_errors(scheduled, outputs)
        return StepResult(plan.step_id, outputs, time.perf_counter() - start)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] -> fp32 [N, V], the padded rows past ``vocab_size`` at -inf."""
        logits = self._lm_head(hidden)
        if self.vocab_size < logits.shape[-1]:
            logits[:, self.vocab_size:] = float("-inf")  # padded rows: ids no tokenizer can decode
        return logits

    def _forward(self, step: ForwardStep, logit_rows: list[int]) -> torch.Tensor:
        """The model over the step's tokens, by the first path that takes it: final hidden states
        [T, D]. ``logit_rows``: the rows whose logits follow (the other ranks' share of a
        vocab-parallel head is of those)."""
        path = next(path for path in self.paths
                    if (step.lora is None or path.applies_lora) and path.takes(step))
        if self.parallel is not None:
            packed = step.packed
            return self.parallel.run_step(packed.input_ids, packed.positions, packed.meta, lambda: path.forward(step),
                                          kind=STEP_KINDS[path.name], logit_rows=logit_rows)
        return path.forward(step)

    def _run_more_steps(self, plan: StepPlan, scheduled: Scheduled,
                        outputs: list[SequenceOutput]) -> None:
        """Multi-step scheduling: sequences asked for n > 1 decode steps run n - 1 more, each
        feeding back the token the last one sampled (RunningSequence.num_steps)."""
        offset = len(plan.new)
        remaining = [(offset + i, running.num_steps - 1) for i, running in enumerate(plan.running)
                     if running.num_steps > 1]
        for step in range(1, max((n for _, n in remaining), default=0) + 1):
            rows = [row for row, n in remaining if n >= step]
            batch = [(scheduled[row][0], 1) for row in rows]
            step_outputs = self._run_step(batch, {})
            for row, out in zip(rows, step_outputs):
                outputs[row].token_ids.extend(out.token_ids)
                if out.logprobs is not None:
                    outputs[row].logprobs = (outputs[row].logprobs or []) + out.logprobs

    def _run_step(self, scheduled: Scheduled, drafts: dict[int, list[int]]) -> list[SequenceOutput]:
        slots = self._lora_slots(scheduled)
        step = ForwardStep(scheduled, self.block_size, self.device, self.kv_groups.num_groups,
                           None if slots is None else LoraBatch.for_rows(self.adapters.stacks, slots, scheduled,
                                                                         self.device))
        # Only sequences whose known tokens are all computed after this step sample a token;
        # a prefill chunk that stops short of the end produces nothing.
        sample_rows = [
            i for i, (state, n) in enumerate(scheduled) if state.num_computed_tokens + n == len(state.token_ids)
        ]
        # The grammar masks depend only on tokens known now: filled on a worker thread while
        # the forward runs (llguidance and torch's kernels both release the GIL).
        masks = self.grammars.submit(self._grammar_masks, _sampling_rows(scheduled, sample_rows, drafts))
        cu = step.query_starts
        # The hidden rows sampled from: each sampling sequence's last token, and before it one a draft.
        logit_rows = [row for i in sample_rows for row in range(cu[i + 1] - 1 - len(drafts.get(i, ())), cu[i + 1])]
        prompt_rows = _prompt_logprob_rows(scheduled, cu)
        rows = logit_rows + [row for _, chunk_rows, _ in prompt_rows for row in chunk_rows]
        hidden = self._forward(step, rows)
        outputs = [SequenceOutput(state.seq_id) for state, _ in scheduled]
        if rows and (prompt_rows or len(rows) < hidden.shape[0]):  # else every row is sampled from, in order
            hidden = hidden[torch.tensor(rows, device=self.device)]
        # One LM head call over every row wanted (a vocab-parallel head's ranks computed those rows).
        all_logits = self._logits(hidden) if rows else None
        if prompt_rows:
            self._prompt_logprobs(all_logits[len(logit_rows):], scheduled, prompt_rows, outputs)
        if sample_rows and drafts:
            self._verify(all_logits[:len(logit_rows)], scheduled, sample_rows, drafts, outputs, masks)
        elif sample_rows:
            logits = all_logits[:len(logit_rows)]  # [S, V] fp32
            states = [scheduled[i][0] for i in sample_rows]
            sampled = self._sample(logits, [(s, 0) for s in states], masks)
            for row, state, (token_id, logprobs) in zip(sample_rows, states, sampled):
                state.token_ids.append(token_id)
                if state.matcher is not None:
                    self.grammars.advance(state.matcher, (token_id,))
                outputs[row].token_ids = [token_id]
                if logprobs is not None:
                    outputs[row].logprobs = [logprobs]
        for index, (state, n) in enumerate(scheduled):
            if index in drafts:
                # K/V is valid for the last known token and the accepted drafts; the emitted
                # token after them has none yet. Rejected drafts' slots are overwritten later.
                state.num_computed_tokens = len(state.token_ids) - 1
            else:
                state.num_computed_tokens += n
        return outputs

    def _prompt_logprobs(self, logits: torch.Tensor, scheduled: Scheduled,
                         prompt_rows: list[tuple[int, range, list[int]]], outputs: list[SequenceOutput]) -> None:
        """The logprob of each prompt token this step's chunks predict, and the top alternatives
        the sequence asked for: raw (log_softmax of the logits, as sampled tokens' logprobs are).
        ``logits`` [R, V]: the rows of ``prompt_rows``, in order."""
        logprobs = torch.log_softmax(logits, dim=-1)  # [R, V]
        targets = torch.tensor([t for _, _, chunk_targets in prompt_rows for t in chunk_targets], device=self.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()  # [R]
        top_n = max(scheduled[i][0].sampling.prompt_logprobs for i, _, _ in prompt_rows)
        top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)  # [R, n] each
        top_values = top_values.tolist() if top_n else None
        top_ids = top_ids.tolist() if top_n else None
        start = 0
        for i, chunk_rows, _ in prompt_rows:
            n = scheduled[i][0].sampling.prompt_logprobs
            entries = []
            for r in range(start, start + len(chunk_rows)):
                entries.append(TokenLogprobs(chosen[r], top_ids[r][:n] if n else [], top_values[r][:n] if n else []))
            outputs[i].prompt_logprobs = entries
            start += len(chunk_rows)

    def _verify(self, logits: torch.Tensor, scheduled: Scheduled, sample_rows: list[int],
                drafts: dict[int, list[int]], outputs: list[SequenceOutput], masks: MaskFuture) -> None:
        """Sample every position of a drafted sequence as a plain decode step there would, then
        keep the drafts the target agrees with (services/runtime/sampling/verify.py). ``logits``
        [R, V]: a row for the last known token of each sampling sequence and each of its drafts."""
        # Row j of k + 1 sees the known tokens and d_1..d_j: k - j trailing drafts hidden.
        rows = _sampling_rows(scheduled, sample_rows, drafts)
        sampled = self._sample(logits, rows, masks)
        start = 0
        for i in sample_rows:
            state = scheduled[i][0]
            draft_ids = drafts.get(i, [])
            k = len(draft_ids)
            targets = sampled[start : start + k + 1]
            start += k + 1
            emitted = emitted_tokens([t for t, _ in targets], draft_ids)
            del state.token_ids[len(state.token_ids) - k :]
            state.token_ids.extend(emitted)
            if state.matcher is not None:
                self.grammars.advance(state.matcher, emitted)
            outputs[i].token_ids = emitted
            if targets[0][1] is not None:
                # Each emitted token is its position's target token, so its logprobs are that row's.
                outputs[i].logprobs = [lp for _, lp in targets[: len(emitted)]]

    def _sample(
        self, logits: torch.Tensor, rows: Scheduled, mask_future: MaskFuture
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """One token (and logprobs if asked) per row of ``logits`` [S, V]. A row is a sequence
        and how many of its last tokens are drafts beyond this row's position (not history);
        ``mask_future`` gives the grammar masks of exactly these rows (``_grammar_masks``)."""
        histories = [(s, len(s.token_ids) - cut) for s, cut in rows]  # (state, end of its history)
        masks = mask_future.result()
        if all(is_plain_greedy(s.sampling, end - s.prompt_len, s.min_tokens_ban) for s, end in histories):
            # The sampler's argmax-only path, without packing a batch that nothing reads. Under a
            # grammar the argmax of the masked logits is the raw argmax whenever the mask allows
            # that token (the first of the maxima stays first among the allowed ones), so only a
            # step where some row's argmax is refused applies masks to the logits (on the CPU a
            # whole-vocabulary pass per row: milliseconds on a busy machine).
            token_ids = logits.argmax(dim=-1).tolist()
            if masks is None or all(token_allowed(masks[1], j, token_ids[row]) for j, row in enumerate(masks[0])):
                return [(token_id, None) for token_id in token_ids]
        batch = SamplingBatch.build(
            [s.sampling for s, _ in histories],
            [s.token_ids[: s.prompt_len] for s, _ in histories],
            [s.token_ids[s.prompt_len : end] for s, end in histories],
            self.model_config.vocab_size,
            self.device,
            [s.min_tokens_ban for s, _ in histories],
            masks,
        )
        return self.sampler(logits, batch).to_lists(batch)

    def _grammar_masks(self, rows: Scheduled) -> tuple[list[int], object] | None:
        """The bitmasks of the rows a grammar constrains: (their indices, [G, W] int32), None
        when none is. A drafted sequence's k + 1 rows (cut k .. 0) take the masks after each of
        its drafts in turn; its matcher sits before the drafts, at cut k."""
        entries: list[tuple[object, int, list[int]]] = []
        constrained: list[int] = []
        for index, (state, cut) in enumerate(rows):
            if state.matcher is None:
                continue
            constrained.append(index)
            if index == 0 or rows[index - 1][0] is not state:  # the sequence's first row
                drafts = state.token_ids[len(state.token_ids) - cut:] if cut else []
                entries.append((state.matcher, len(constrained) - 1, drafts))
        if not constrained:
            return None
        return constrained, self.grammars.fill(len(constrained), entries)


def _report_grammar_errors(scheduled: Scheduled, outputs: list[SequenceOutput]) -> None:
    """Mark the outputs of sequences whose matcher failed (at a parser limit, or refusing a
    token): their requests end with the error, never with a silent EOS."""
    for (state, _), output in zip(scheduled, outputs):
        if state.grammar_error is None and state.matcher is not None and state.matcher.is_error():
            state.grammar_error = GrammarMatchers.failure(state.matcher)
            state.matcher = None  # unconstrained until the scheduler ends it; its tokens are dropped
        output.error = state.grammar_error or state.adapter_error


def _sampling_rows(scheduled: Scheduled, sample_rows: list[int], drafts: dict[int, list[int]]) -> Scheduled:
    """The rows ``_sample`` will see: one per sampling sequence, k + 1 for one with k drafts
    (row j hides the k - j drafts after its position)."""
    rows: Scheduled = []
    for i in sample_rows:
        k = len(drafts.get(i, ()))
        rows.extend((scheduled[i][0], k - j) for j in range(k + 1))
    return rows


def _adapter_info(adapter: LoraAdapter) -> AdapterInfo:
    return AdapterInfo(adapter.name, str(adapter.path), adapter.rank, adapter.alpha, adapter.target_modules,
                       adapter.fingerprint)


def _max_model_len(config: ExecutorConfig, model_config: ModelConfig) -> int:
    if config.max_model_len > model_config.max_model_len:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {model_config.max_model_len}")
    return config.max_model_len or model_config.max_model_len


def _kv_storage_dtype(config: ExecutorConfig, dtype: torch.dtype, backend_name: str, device: torch.device
                      ) -> torch.dtype:
    kv_dtype = parse_kv_cache_dtype(config.kv_cache_dtype) or dtype
    if (kv_dtype == torch.float8_e4m3fn and backend_name == "triton" and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)):
        raise ValueError(f"kv_cache_dtype fp8_e4m3 with the triton backend needs a GPU of compute capability "
                         f">= 8.9 (float8 e4m3 conversions); {device} has "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    return kv_dtype


def _blocks_for_budget(config: ExecutorConfig, model_config: ModelConfig, kv_dtype: torch.dtype,
                       device: torch.device, groups: KVGroups) -> int:
    if device.type == "cuda":
        budget = cuda_kv_budget(device, config.gpu_memory_utilization)
        # Keep headroom for activations of a full step, measured roughly as 10% of the budget.
        budget = int(budget * 0.9)
    else:
        budget = config.kv_cache_bytes
    return num_blocks_for_budget(model_config, config.block_size, kv_dtype, budget, groups)
