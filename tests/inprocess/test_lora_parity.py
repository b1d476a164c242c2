"""LoRA adapters in one mixed batch match transformers + peft with each adapter merged.

A small random-weight Llama (two layers, GQA) and three random PEFT adapters of the real target
modules (all seven; q/v with rslora; the MLP at the largest rank), served with max_loras=2 so the
third evicts one and an evicted one is read again from its directory. Greedy tokens are compared
exactly; each adapter is checked to change the base model's answers, so a run that ignored the
adapters would fail. The model is small enough for the fused CPU step, which runs the adapter
steps by default; one test also runs them eagerly.
"""

from __future__ import annotations

import pytest

from services.common.errors import NotFoundError
from services.common.sampling_params import SamplingParams
from services.drafter.proposer import DraftMethod, Proposer, ProposerInfo, ProposerSession
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.speculation import SpeculationConfig
from services.scheduler.request.stop import StopConditions
from tests.helpers.forward_paths import fused_decode
from tests.helpers.lora_adapters import BLOCK_SIZE, NEW_TOKENS, tiny_served


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model dir, adapter dirs, prompts, expected greedy tokens per adapter; "" = the base)."""
    return tiny_served(tmp_path_factory.mktemp("lora"))


def engine_for(served, **settings) -> Engine:
    model, paths, _, _ = served
    config = ExecutorConfig(model=str(model), dtype="fp32", device="cpu", block_size=BLOCK_SIZE,
                            lora=tuple(f"{name}={path}" for name, path in paths.items()), **settings)
    return Engine(EngineConfig(config))


def run(engine: Engine, batch: list[tuple[list[int], str]]) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and cached prompt tokens of each (prompt, adapter), all submitted at once."""
    tokens: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    for index, delta in engine.generate([p for p, _ in batch], SamplingParams(temperature=0.0),
                                        StopConditions(max_tokens=NEW_TOKENS, ignore_eos=True),
                                        adapters=[name for _, name in batch]):
        assert delta.error_message is None, delta.error_message
        tokens.setdefault(index, []).extend(delta.token_ids)
        if delta.usage is not None:
            cached[index] = delta.usage.cached_tokens
    return [tokens[i] for i in range(len(batch))], [cached[i] for i in range(len(batch))]


@pytest.mark.parametrize("cpu_decode", ["auto", "eager"])
def test_mixed_adapters_and_base_in_one_batch_match_peft_merged(served, cpu_decode):
    """auto: the fused C++ step adds the adapters (fused_decode.cpp); eager: the PyTorch forward."""
    _, _, prompts, expected = served
    engine = engine_for(served, max_loras=2, fused_decode=FusedDecodeSettings(cpu_decode=cpu_decode))
    names = ["", "all", "qv", "mlp"]
    batch = [(prompts[p], name) for p in range(len(prompts)) for name in names]
    outputs, _ = run(engine, batch)
    for (prompt, name), got in zip(batch, outputs):
        assert got == expected[name][prompts.index(prompt)], f"adapter {name or 'base'}"
    assert engine.runner.adapters.loads >= 4  # three adapters through two slots: one read again
    fused = fused_decode(engine.runner)
    # The fused step was handed the adapters, so their rows ran there.
    assert (fused is not None and fused._lora_stacks is engine.runner.adapters.stacks) == (cpu_decode == "auto")
    engine.close()


def test_a_cached_prefix_of_one_adapter_never_serves_another(served):
    """The same prompt under adapter X, then Y, then the base, then X again: only the last reuses
    X's blocks, and every answer is still its own adapter's."""
    _, _, prompts, expected = served
    engine = engine_for(served, max_loras=2)
    order = ["all", "qv", "", "mlp", "all"]
    cached = []
    for name in order:
        outputs, hits = run(engine, [(prompts[0], name)])
        assert outputs[0] == expected[name][0], f"adapter {name or 'base'} after {cached}"
        cached.append(hits[0])
    assert cached[:4] == [0, 0, 0, 0], cached
    assert cached[4] == 2 * BLOCK_SIZE, cached  # the cache is on: X's own blocks serve X
    engine.close()


def test_preempted_adapter_sequences_resume_exactly(served):
    """A KV pool too small for every sequence at once: sequences are preempted and recomputed,
    with their adapter, and still match peft."""
    _, _, prompts, expected = served
    # Each sequence is admitted with 3 blocks and needs a 4th: 7 blocks cannot grow two.
    engine = engine_for(served, max_loras=3, num_blocks=7, max_model_len=96)
    batch = [(prompts[p], name) for name in ["all", "qv", "mlp", ""] for p in range(len(prompts))]
    outputs, _ = run(engine, batch)
    for (prompt, name), got in zip(batch, outputs):
        assert got == expected[name][prompts.index(prompt)], f"adapter {name or 'base'}"
    assert engine.core.stats().num_preemptions > 0
    engine.close()


class AnswerDrafts(Proposer):
    """Drafts the continuation one adapter's reference gives each prompt: right for that adapter's
    sequences (accepted), wrong for the others' (rejected), so both verify paths run."""

    def __init__(self, prompts: list[list[int]], answers: list[list[int]]) -> None:
        self.prompts, self.answers = prompts, answers

    def new_session(self) -> ProposerSession:
        return AnswerSession(self)

    def info(self) -> ProposerInfo:
        return ProposerInfo(DraftMethod.NGRAM, 4)


class AnswerSession(ProposerSession):
    def __init__(self, proposer: AnswerDrafts) -> None:
        self.proposer = proposer
        self.tokens: dict[int, list[int]] = {}

    def open(self, seq_id, token_ids):
        self.tokens[seq_id] = list(token_ids)

    def append(self, seq_id, token_ids):
        self.tokens[seq_id].extend(token_ids)

    def close(self, seq_id):
        self.tokens.pop(seq_id, None)

    def close_all(self):
        self.tokens.clear()

    def propose_batch(self, seq_ids, num_tokens=None):
        drafts = []
        for seq_id in seq_ids:
            tokens = self.tokens[seq_id]
            prompt = next(p for p in self.proposer.prompts if tokens[:len(p)] == p)
            done = len(tokens) - len(prompt)
            drafts.append(self.proposer.answers[self.proposer.prompts.index(prompt)][done: done + (num_tokens or 4)])
        return drafts

    def __contains__(self, seq_id):
        return seq_id in self.tokens

    def __len__(self):
        return len(self.tokens)


def test_speculative_drafts_are_verified_with_each_rows_adapter(served):
    model, paths, prompts, expected = served
    config = ExecutorConfig(model=str(model), dtype="fp32", device="cpu", block_size=BLOCK_SIZE, max_loras=3,
                            lora=tuple(f"{name}={path}" for name, path in paths.items()))
    engine = Engine(EngineConfig(config, speculation=SpeculationConfig(num_speculative_tokens=4, adaptive=False)),
                    proposer=AnswerDrafts(prompts, expected["all"]))
    batch = [(prompts[p], name) for p in range(len(prompts)) for name in ["", "all", "qv", "mlp"]]
    outputs, _ = run(engine, batch)
    for (prompt, name), got in zip(batch, outputs):
        assert got == expected[name][prompts.index(prompt)], f"adapter {name or 'base'}"
    spec = engine.scheduler.get_stats().spec_decode
    assert spec.num_accepted_tokens >= NEW_TOKENS  # the "all" rows took their drafts
    assert spec.num_draft_tokens > spec.num_accepted_tokens  # and the other rows' drafts were refused
    engine.close()


def test_adapters_load_and_unload_while_serving_and_one_slot_serves_them_in_turn(served):
    """No --lora: adapters loaded into a running engine with one slot, each answering as peft
    does (the slot rewritten between them), the base unchanged; an unloaded adapter is refused
    by name, and a name loaded again is served from its files again."""
    model, paths, prompts, expected = served
    engine = Engine(EngineConfig(ExecutorConfig(model=str(model), dtype="fp32", device="cpu", block_size=BLOCK_SIZE,
                                                max_loras=1)))
    info = engine.load_adapter("qv", str(paths["qv"]))
    assert (info.rank, info.target_modules) == (4, ("q_proj", "v_proj"))
    engine.load_adapter("mlp", str(paths["mlp"]))
    # One slot: the scheduler runs the two adapters' requests one adapter at a time.
    batch = [(prompts[0], "qv"), (prompts[0], "mlp"), (prompts[1], ""), (prompts[1], "qv")]
    outputs, _ = run(engine, batch)
    assert outputs == [expected["qv"][0], expected["mlp"][0], expected[""][1], expected["qv"][1]]
    assert engine.unload_adapter("qv") and not engine.unload_adapter("qv")
    with pytest.raises(NotFoundError, match="adapter 'qv' is not loaded on this engine"):
        engine.add_request(prompts[0], SamplingParams(temperature=0.0), adapter="qv")
    engine.load_adapter("qv", str(paths["all"]))  # the name now holds other weights
    outputs, cached = run(engine, [(prompts[0], "qv")])
    assert outputs[0] == expected["all"][0] and cached == [0]
    engine.close()


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_adapters_on_a_quantized_base_match_peft_on_its_dequantized_weights(tmp_path, scheme):
    """Q4_1 / Q8_0 base weights (`tokenmill quantize`), fp32 adapters: with exact fp32 activations
    (quant_activations none) each adapter's greedy tokens equal transformers + peft merged on the
    dequantized model, which holds exactly the quantized numbers; tolerance: none on the tokens."""
    import random

    from services.tools.quantize import quantize_model
    from services.tools.random_model import build_random_model
    from tests.conftest import STORIES_DIR
    from tests.helpers.lora_adapters import TINY_SPECS, make_adapters
    from tests.helpers.parity_specs import PARITY_SPECS
    from tests.helpers.quant_models import write_dequantized

    float_dir = build_random_model(PARITY_SPECS["llama-gqa-8-2"], tmp_path / "float", tokenizer_from=STORIES_DIR)
    quant_dir = tmp_path / "quantized"
    quantize_model(float_dir, quant_dir, scheme)
    reference_dir = write_dequantized(quant_dir, tmp_path / "dequantized")
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 512) for _ in range(2 * BLOCK_SIZE + 5)]]
    paths, expected = make_adapters(reference_dir, tmp_path / "adapters", TINY_SPECS[:2], prompts, NEW_TOKENS)
    engine = Engine(EngineConfig(ExecutorConfig(
        model=str(quant_dir), device="cpu", block_size=BLOCK_SIZE, quant_activations="none",
        lora=tuple(f"{name}={path}" for name, path in paths.items()))))
    from services.runtime.model.quant.linear import QuantLinear

    kept = {m.path for m in engine.runner.model.modules() if isinstance(m, QuantLinear)}
    assert "cpu_kernel" in kept, kept  # the base projections run on their quantized weights
    names = ["", *paths]
    outputs, _ = run(engine, [(prompts[0], name) for name in names])
    engine.close()
    for name, got in zip(names, outputs):
        assert got == expected[name][0], f"{scheme}, adapter {name or 'base'}"
    assert all(expected[name] != expected[""] for name in paths)  # the adapters change the answers
