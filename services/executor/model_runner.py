"""The model runner: turns a StepPlan into tensors, runs one forward, samples, returns a StepResult.

It keeps the state of every running sequence between steps (token ids, block table,
computed count, sampling parameters), so a step only carries diffs. Logits never leave
it: the result holds sampled ids and, when asked, logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.attention.registry import get_attention_backend, resolve_backend_name
from services.runtime.model.config import ModelConfig, dtype_name, parse_dtype
from services.runtime.model.llama import LlamaForCausalLM
from services.common.sampling_params import SamplingParams
from services.common.stop import MinTokensBan
from services.runtime.sampling.sampler import Sampler, SamplingBatch
from services.common.step import ExecutorInfo, SequenceOutput, StepPlan, StepResult
from services.executor.config import ExecutorConfig
from services.runtime.kv_cache import KVCache, cuda_kv_budget, num_blocks_for_budget


@dataclass(slots=True)
class SequenceState:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    min_tokens_ban: MinTokensBan | None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return parse_dtype(name)
    # Half precision on a CPU is slow and loses accuracy for no memory benefit worth having here.
    if device.type == "cpu":
        return torch.float32
    return config.dtype if config.dtype != torch.float32 else torch.bfloat16


class ModelRunner:
    def __init__(self, config: ExecutorConfig):
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_model_dir(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.backend_name = resolve_backend_name(config.attention_backend, self.device)
        self.backend = get_attention_backend(self.backend_name, self.device)
        self.model = LlamaForCausalLM.from_pretrained(
            config.model, self.backend, self.device, self.dtype, self.model_config
        )
        self.block_size = config.block_size
        self.max_model_len = self.model_config.max_model_len
        if config.max_model_len:
            if config.max_model_len > self.max_model_len:
                raise ValueError(
                    f"max_model_len {config.max_model_len} exceeds the model's limit {self.max_model_len}"
                )
            self.max_model_len = config.max_model_len
        self.kv_cache = KVCache.allocate(
            self.model_config, self._num_blocks(), self.block_size, self.dtype, self.device
        )
        self.sampler = Sampler(seed=config.seed)
        self.sequences: dict[int, SequenceState] = {}

    def _num_blocks(self) -> int:
        if self.config.num_blocks:
            return self.config.num_blocks
        if self.device.type == "cuda":
            budget = cuda_kv_budget(self.device, self.config.gpu_memory_utilization)
            # Keep headroom for activations of a full step, measured roughly as 10% of the budget.
            budget = int(budget * 0.9)
        else:
            budget = self.config.kv_cache_bytes
        return num_blocks_for_budget(self.model_config, self.block_size, self.dtype, budget)

    def info(self) -> ExecutorInfo:
        mc = self.model_config
        return ExecutorInfo(
            num_blocks=self.kv_cache.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=mc.vocab_size,
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            attention_backend=self.backend_name,
            model=str(self.config.model),
            architecture=mc.architecture,
            bos_token_id=mc.bos_token_id,
            eos_token_ids=mc.eos_token_ids,
        )

    # ------------------------------------------------------------------ state diffs
    def _check_block_ids(self, seq_id: int, block_ids) -> None:
        # Kernels index the pool with these ids: one outside it must never reach a kernel.
        num_blocks = self.kv_cache.num_blocks
        for block in block_ids:
            if not 0 <= block < num_blocks:
                raise ValueError(f"sequence {seq_id}: block id {block} is outside the KV pool of {num_blocks} blocks")

    def _apply_plan(self, plan: StepPlan) -> list[tuple[SequenceState, int]]:
        for seq_id in plan.finished_seq_ids:
            self.sequences.pop(seq_id, None)
        scheduled: list[tuple[SequenceState, int]] = []
        for new in plan.new:
            if new.seq_id in self.sequences:
                raise ValueError(f"sequence {new.seq_id} is already running in the executor")
            self._check_block_ids(new.seq_id, new.block_ids)
            state = SequenceState(
                new.seq_id, list(new.token_ids), new.prompt_len, list(new.block_ids),
                new.num_computed_tokens, new.sampling, new.min_tokens_ban,
            )
            self.sequences[new.seq_id] = state
            scheduled.append((state, new.num_scheduled_tokens))
        for running in plan.running:
            state = self.sequences.get(running.seq_id)
            if state is None:
                raise ValueError(f"step {plan.step_id} continues unknown sequence {running.seq_id}")
            if running.draft_token_ids:
                raise ValueError("speculative draft tokens are not supported by this executor yet")
            self._check_block_ids(running.seq_id, running.new_block_ids)
            state.block_ids.extend(running.new_block_ids)
            scheduled.append((state, running.num_scheduled_tokens))
        for state, n in scheduled:
            end = state.num_computed_tokens + n
            if n <= 0 or end > len(state.token_ids):
                raise ValueError(
                    f"sequence {state.seq_id}: {n} scheduled tokens from {state.num_computed_tokens} "
                    f"exceed its {len(state.token_ids)} known tokens"
                )
            if end > len(state.block_ids) * self.block_size:
                raise ValueError(
                    f"sequence {state.seq_id}: {end} tokens need {-(-end // self.block_size)} blocks, "
                    f"its block table has {len(state.block_ids)}"
                )
        return scheduled

    def _prepare(self, scheduled: list[tuple[SequenceState, int]]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        bs = self.block_size
        for state, n in scheduled:
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            blocks = state.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
        width = max(len(s.block_ids) for s, _ in scheduled)
        table = [s.block_ids + [0] * (width - len(s.block_ids)) for s, _ in scheduled]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(table, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=dev),
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            block_size=bs,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, cu

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        scheduled = self._apply_plan(plan)
        if not scheduled:
            return StepResult(plan.step_id, [])
        ids, pos, meta, cu = self._prepare(scheduled)
        hidden = self.model(ids, pos, self.kv_cache.layers, meta)
        # Only sequences whose known tokens are all computed after this step sample a token;
        # a prefill chunk that stops short of the end produces nothing.
        sample_rows = [
            i for i, (state, n) in enumerate(scheduled) if state.num_computed_tokens + n == len(state.token_ids)
        ]
        outputs = [SequenceOutput(state.seq_id) for state, _ in scheduled]
        if sample_rows:
            last_token = torch.tensor([cu[i + 1] - 1 for i in sample_rows], device=self.device)
            logits = self.model.compute_logits(hidden[last_token])  # [S, V] fp32
            states = [scheduled[i][0] for i in sample_rows]
            batch = SamplingBatch.build(
                [s.sampling for s in states],
                [s.token_ids[: s.prompt_len] for s in states],
                [s.token_ids[s.prompt_len :] for s in states],
                self.model_config.vocab_size,
                self.device,
                [s.min_tokens_ban for s in states],
            )
            sampled = self.sampler(logits, batch).to_lists(batch)
            for row, state, (token_id, logprobs) in zip(sample_rows, states, sampled):
                state.token_ids.append(token_id)
                outputs[row].token_ids = [token_id]
                if logprobs is not None:
                    outputs[row].logprobs = [logprobs]
        for state, n in scheduled:
            state.num_computed_tokens += n
        return StepResult(plan.step_id, outputs)
