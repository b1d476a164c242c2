"""LoRA adapters in one mixed batch match transformers + peft with each adapter merged.

Three random PEFT adapters of SmolLM2's real target modules (all seven; q/v with rslora; the
MLP at the largest rank), served with max_loras=2 so the third evicts one and an evicted one is
read again; every prompt runs with each adapter and with the base, all submitted at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.sampling_params import SamplingParams
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.request.stop import StopConditions
from tests.helpers.lora_adapters import ALL_TARGETS, AdapterSpec, make_adapters

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
NEW_TOKENS = 16


@pytest.mark.slow
def test_mixed_adapters_match_peft_merged(tmp_path):
    assert (SMOLLM2_DIR / "config.json").is_file(), f"{SMOLLM2_DIR} is absent: `make install` converts it"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("def fibonacci(n):")]
    specs = [AdapterSpec("all", ALL_TARGETS, 8, 16), AdapterSpec("qv", ("q_proj", "v_proj"), 4, 8, True, 1),
             AdapterSpec("mlp", ("gate_proj", "up_proj", "down_proj"), 16, 16, False, 2)]
    paths, expected = make_adapters(SMOLLM2_DIR, tmp_path, specs, prompts, NEW_TOKENS)
    config = ExecutorConfig(model=str(SMOLLM2_DIR), dtype="fp32", device="cpu", max_loras=2,
                            lora=tuple(f"{name}={path}" for name, path in paths.items()))
    engine = Engine(EngineConfig(config))
    names = ["", "all", "qv", "mlp"]
    batch = [(p, name) for p in range(len(prompts)) for name in names]
    outputs: dict[int, list[int]] = {}
    for index, delta in engine.generate([prompts[p] for p, _ in batch], SamplingParams(temperature=0.0),
                                        StopConditions(max_tokens=NEW_TOKENS, ignore_eos=True),
                                        adapters=[name for _, name in batch]):
        outputs.setdefault(index, []).extend(delta.token_ids)
    for index, (p, name) in enumerate(batch):
        assert outputs[index] == expected[name][p], f"prompt {p}, adapter {name or 'base'}"
    assert engine.runner.adapters.loads >= 4  # three adapters through two slots: one read again
