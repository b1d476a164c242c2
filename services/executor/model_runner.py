"""The model runner: turns a StepPlan into tensors, runs one forward, samples, returns a StepResult.

It keeps the state of every running sequence between steps (token ids, block table,
computed count, sampling parameters), so a step only carries diffs. Logits never leave
it: the result holds sampled ids and, when asked, logprobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

import torch

from services.runtime.model.attention.registry import get_attention_backend, resolve_backend_name
from services.runtime.model.config import ModelConfig, dtype_name
from services.runtime.model.llama import LlamaForCausalLM
from services.common.sampling_params import SamplingParams
from services.common.step import MinTokensBan
from services.runtime.sampling.batch import is_plain_greedy
from services.runtime.sampling.sampler import Sampler, SamplingBatch
from services.runtime.sampling.verify import emitted_tokens
from services.common.step import ExecutorInfo, SequenceOutput, StepPlan, StepResult, TokenLogprobs
from services.executor.config import ExecutorConfig
from services.runtime.kernels.kv_quant import parse_kv_cache_dtype
from services.runtime.device import resolve_device, resolve_dtype
from services.runtime.step_inputs import pack_step_inputs
from services.runtime.kv_cache import KVCache, bytes_per_block, cuda_kv_budget, num_blocks_for_budget

_log = structlog.get_logger("tokenmill.model")


@dataclass(slots=True)
class SequenceState:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    min_tokens_ban: MinTokensBan | None


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
            config.model, self.backend, self.device, self.dtype, self.model_config,
            # inductor cannot lower oneDNN's prepacked linear; the compiled step multiplies plain weights
            prepack_cpu_weights=not config.compile,
        )
        self.compiled_decode = None
        if config.compile:
            # Imported only when asked for: it brings in torch.compile's machinery.
            from services.runtime.model.compiled_decode import CompiledDecode

            self.compiled_decode = CompiledDecode(self.model)
        self.block_size = config.block_size
        self.max_model_len = self.model_config.max_model_len
        if config.max_model_len:
            if config.max_model_len > self.max_model_len:
                raise ValueError(
                    f"max_model_len {config.max_model_len} exceeds the model's limit {self.max_model_len}"
                )
            self.max_model_len = config.max_model_len
        self.decode_graph_mode = self._decode_graph_mode()
        # Decode graphs pad batches with rows that write into a scratch block past the pool the
        # scheduler is told about (decode_graphs.py).
        # The pool's storage: the model's dtype, or int8 / float8_e4m3fn values with scales.
        self.kv_dtype = parse_kv_cache_dtype(config.kv_cache_dtype) or self.dtype
        if (self.kv_dtype == torch.float8_e4m3fn and self.backend_name == "triton" and self.device.type == "cuda"
                and torch.cuda.get_device_capability(self.device) < (8, 9)):
            raise ValueError(f"kv_cache_dtype fp8_e4m3 with the triton backend needs a GPU of compute capability "
                             f">= 8.9 (float8 e4m3 conversions); {self.device} has "
                             f"{'.'.join(map(str, torch.cuda.get_device_capability(self.device)))}")
        self.num_usable_blocks = self._num_blocks()
        self.kv_cache = KVCache.allocate(
            self.model_config, self.num_usable_blocks + (self.decode_graph_mode is not None),
            self.block_size, self.kv_dtype, self.device,
        )
        self.decode_graphs = None
        if self.decode_graph_mode is not None:
            from services.executor.decode_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_cache.layers, block_size=self.block_size, max_model_len=self.max_model_len,
                max_batch_size=config.cuda_graph_max_batch_size, scratch_block=self.num_usable_blocks,
                device=self.device, capture=self.decode_graph_mode == "capture",
            )
        self.fused_decode = self._fused_decode()
        self.sampler = Sampler(seed=config.seed)
        self.sequences: dict[int, SequenceState] = {}

    def _fused_decode(self):
        """The fused C++ decode step (fused_decode.py) where ``cpu_decode`` and the model allow it."""
        config = self.config
        if (self.device.type != "cpu" or config.cpu_decode == "eager" or self.compiled_decode is not None
                or self.decode_graphs is not None):
            return None
        from services.runtime.model.fused_decode import FusedDecode, why_not

        reason = why_not(self.model, self.kv_cache.layers)
        if reason is not None:
            if config.cpu_decode == "fused":
                raise ValueError(f"cpu_decode 'fused': the fused CPU decode step cannot run this model: {reason}")
            _log.info("cpu decode path", path="eager", reason=reason)
            return None
        _log.info("cpu decode path", path="fused")
        return FusedDecode(self.model, self.kv_cache.layers, max_step_tokens=config.cpu_fused_max_tokens)

    def _decode_graph_mode(self) -> str | None:
        """"capture" (CUDA graphs), "padded" (their buffers, run eagerly on a CPU) or None."""
        config = self.config
        if self.device.type == "cuda":
            from services.executor.decode_graphs import GRAPH_BACKENDS

            if not config.enforce_eager and self.backend_name in GRAPH_BACKENDS:
                return "capture"
            return None
        return "padded" if config.padded_decode_on_cpu and not config.compile else None

    def _num_blocks(self) -> int:
        if self.config.num_blocks:
            return self.config.num_blocks
        if self.device.type == "cuda":
            budget = cuda_kv_budget(self.device, self.config.gpu_memory_utilization)
            # Keep headroom for activations of a full step, measured roughly as 10% of the budget.
            budget = int(budget * 0.9)
        else:
            budget = self.config.kv_cache_bytes
        return num_blocks_for_budget(self.model_config, self.block_size, self.kv_dtype, budget)

    def info(self) -> ExecutorInfo:
        mc = self.model_config
        return ExecutorInfo(
            num_blocks=self.num_usable_blocks,
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
            kv_cache_dtype=dtype_name(self.dtype) if self.config.kv_cache_dtype == "auto" else self.config.kv_cache_dtype,
            kv_cache_bytes=self.num_usable_blocks * bytes_per_block(mc, self.block_size, self.kv_dtype),
        )

    # ------------------------------------------------------------------ state diffs
    def _check_block_ids(self, seq_id: int, block_ids) -> None:
        # Kernels index the pool with these ids: one outside it must never reach a kernel.
        num_blocks = self.num_usable_blocks
        for block in block_ids:
            if not 0 <= block < num_blocks:
                raise ValueError(f"sequence {seq_id}: block id {block} is outside the KV pool of {num_blocks} blocks")

    def _take_drafts(self, state: SequenceState, num_scheduled: int, draft_ids: list[int]) -> None:
        """Append a running sequence's drafts to its tokens for this step: they are just more
        scheduled tokens after the last known one (which has no K/V yet)."""
        if num_scheduled != 1 + len(draft_ids):
            raise ValueError(f"sequence {state.seq_id}: {num_scheduled} scheduled tokens with "
                             f"{len(draft_ids)} drafts; expected 1 + {len(draft_ids)}")
        if state.num_computed_tokens + 1 != len(state.token_ids):
            raise ValueError(f"sequence {state.seq_id}: drafts must follow the last known token, but "
                             f"{len(state.token_ids) - state.num_computed_tokens} tokens are not computed")
        vocab = self.model_config.vocab_size
        for index, token_id in enumerate(draft_ids):
            if not 0 <= token_id < vocab:
                raise ValueError(f"sequence {state.seq_id}: draft_token_ids[{index}] = {token_id} is "
                                 f"outside [0, {vocab})")
        state.token_ids.extend(draft_ids)

    def _apply_plan(self, plan: StepPlan, drafts: dict[int, list[int]]) -> list[tuple[SequenceState, int]]:
        """Apply the plan's diffs; ``drafts`` receives the draft tokens by scheduled row."""
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
            self._check_block_ids(running.seq_id, running.new_block_ids)
            state.block_ids.extend(running.new_block_ids)
            if running.num_steps > 1:
                self._check_multi_step(state, running)
            if running.draft_token_ids:
                self._take_drafts(state, running.num_scheduled_tokens, running.draft_token_ids)
                drafts[len(scheduled)] = running.draft_token_ids
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

    def _check_multi_step(self, state: SequenceState, running) -> None:
        """n decode steps back to back: a decode of the last known token, with blocks for all n positions."""
        if running.num_scheduled_tokens != 1 or running.draft_token_ids \
                or state.num_computed_tokens + 1 != len(state.token_ids):
            raise ValueError(f"sequence {state.seq_id}: {running.num_steps} decode steps need a decode of its last "
                             f"known token (1 scheduled token, no drafts); it schedules "
                             f"{running.num_scheduled_tokens} from {state.num_computed_tokens} of "
                             f"{len(state.token_ids)} known tokens")
        end = state.num_computed_tokens + running.num_steps
        if end > len(state.block_ids) * self.block_size:
            raise ValueError(f"sequence {state.seq_id}: {running.num_steps} decode steps reach position {end - 1}, "
                             f"which needs {-(-end // self.block_size)} blocks; its block table has "
                             f"{len(state.block_ids)}")

    def _prepare(self, scheduled: list[tuple[SequenceState, int]]):
        """The step's tensors, built from Python lists in two host-to-device copies.

        int64 [input ids | positions | slots] and int32 [context lens | query starts | block
        table]; every tensor the model reads is a view into one of the two. A decode row (one
        token) appends scalars; only longer rows build ranges.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        bs = self.block_size
        for state, n in scheduled:
            start = state.num_computed_tokens
            blocks = state.block_ids
            if n == 1:
                input_ids.append(state.token_ids[start])
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                input_ids.extend(state.token_ids[start : start + n])
                positions.extend(range(start, start + n))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
        return pack_step_inputs(input_ids, positions, slots, query_lens, context_lens,
                                [state.block_ids for state, _ in scheduled], bs, self.device)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        drafts: dict[int, list[int]] = {}
        scheduled = self._apply_plan(plan, drafts)
        if not scheduled:
            return StepResult(plan.step_id, [])
        outputs = self._run_step(scheduled, drafts)
        self._run_more_steps(plan, scheduled, outputs)
        return StepResult(plan.step_id, outputs, time.perf_counter() - start)

    def _forward(self, scheduled: list[tuple[SequenceState, int]]) -> tuple[torch.Tensor, list[int]]:
        """The model over the scheduled tokens: final hidden states [T, D] and query starts."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.takes(
            len(scheduled), [n for _, n in scheduled], max(len(s.block_ids) for s, _ in scheduled)
        ):
            hidden = graphs.run([
                (s.token_ids[s.num_computed_tokens], s.num_computed_tokens, s.block_ids) for s, _ in scheduled
            ])
            return hidden, list(range(len(scheduled) + 1))
        ids, pos, meta, cu = self._prepare(scheduled)
        if self.compiled_decode is not None and self.compiled_decode.takes(meta):
            return self.compiled_decode(ids, pos, self.kv_cache.layers, meta), cu
        if self.fused_decode is not None and self.fused_decode.takes(meta):
            return self.fused_decode(ids, pos, self.kv_cache.layers, meta), cu
        return self.model(ids, pos, self.kv_cache.layers, meta), cu

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] -> fp32 [N, V]: through the fused CPU step's LM head where it has one (a row's
        logits then never depend on its batch), else the model's."""
        fused = self.fused_decode
        if fused is not None and fused.computes_logits:
            return fused.logits(hidden)
        return self.model.compute_logits(hidden)

    def _run_more_steps(self, plan: StepPlan, scheduled: list[tuple[SequenceState, int]],
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

    def _run_step(self, scheduled: list[tuple[SequenceState, int]], drafts: dict[int, list[int]]) -> list[SequenceOutput]:
        hidden, cu = self._forward(scheduled)
        # Only sequences whose known tokens are all computed after this step sample a token;
        # a prefill chunk that stops short of the end produces nothing.
        sample_rows = [
            i for i, (state, n) in enumerate(scheduled) if state.num_computed_tokens + n == len(state.token_ids)
        ]
        outputs = [SequenceOutput(state.seq_id) for state, _ in scheduled]
        if sample_rows and drafts:
            self._verify(hidden, cu, scheduled, sample_rows, drafts, outputs)
        elif sample_rows:
            if len(sample_rows) < hidden.shape[0]:  # else every token is a sampling row's only one
                hidden = hidden[torch.tensor([cu[i + 1] - 1 for i in sample_rows], device=self.device)]
            logits = self._logits(hidden)  # [S, V] fp32
            states = [scheduled[i][0] for i in sample_rows]
            sampled = self._sample(logits, [(s, 0) for s in states])
            for row, state, (token_id, logprobs) in zip(sample_rows, states, sampled):
                state.token_ids.append(token_id)
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

    def _verify(self, hidden: torch.Tensor, cu: list[int], scheduled: list[tuple[SequenceState, int]],
                sample_rows: list[int], drafts: dict[int, list[int]], outputs: list[SequenceOutput]) -> None:
        """Sample every position of a drafted sequence as a plain decode step there would, then
        keep the drafts the target agrees with (services/runtime/sampling/verify.py)."""
        hidden_rows: list[int] = []
        rows: list[tuple[SequenceState, int]] = []
        for i in sample_rows:
            k = len(drafts.get(i, ()))
            hidden_rows.extend(range(cu[i + 1] - 1 - k, cu[i + 1]))
            # Row j of k + 1 sees the known tokens and d_1..d_j: k - j trailing drafts hidden.
            rows.extend((scheduled[i][0], k - j) for j in range(k + 1))
        logits = self._logits(hidden[torch.tensor(hidden_rows, device=self.device)])  # [R, V]
        sampled = self._sample(logits, rows)
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
            outputs[i].token_ids = emitted
            if targets[0][1] is not None:
                # Each emitted token is its position's target token, so its logprobs are that row's.
                outputs[i].logprobs = [lp for _, lp in targets[: len(emitted)]]

    def _sample(
        self, logits: torch.Tensor, rows: list[tuple[SequenceState, int]]
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """One token (and logprobs if asked) per row of ``logits`` [S, V]. A row is a sequence
        and how many of its last tokens are drafts beyond this row's position (not history)."""
        histories = [(s, len(s.token_ids) - cut) for s, cut in rows]  # (state, end of its history)
        if all(is_plain_greedy(s.sampling, end - s.prompt_len, s.min_tokens_ban) for s, end in histories):
            # The sampler's argmax-only path, without packing a batch that nothing reads.
            return [(token_id, None) for token_id in logits.argmax(dim=-1).tolist()]
        batch = SamplingBatch.build(
            [s.sampling for s, _ in histories],
            [s.token_ids[: s.prompt_len] for s, _ in histories],
            [s.token_ids[s.prompt_len : end] for s, end in histories],
            self.model_config.vocab_size,
            self.device,
            [s.min_tokens_ban for s, _ in histories],
        )
        return self.sampler(logits, batch).to_lists(batch)
