"""The weights benchmark's measuring parts on stories260K: its perplexity equals Hugging Face
transformers' on the same ids, its request runner returns every token, its report compares
each format with fp32, and its flags are checked."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import weights
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from tests.conftest import STORIES_DIR

TEXT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun."


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), dtype="fp32", device="cpu", num_blocks=64)))


def test_perplexity_equals_transformers_on_the_same_ids(engine):
    transformers = pytest.importorskip("transformers")
    ppl, n = weights.perplexity(engine, TEXT)
    ids = torch.tensor([engine.encode_prompt(TEXT)])
    assert n == ids.shape[1] > 10
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss.item()
    assert ppl == pytest.approx(math.exp(loss), rel=1e-4)
    assert engine.runner.sequences == {}


def test_requests_run_to_their_length_greedily(engine):
    prompts = [engine.encode_prompt("Once upon a time"), engine.encode_prompt("The cat")]
    seconds, outputs = weights.run_requests(engine, prompts * 2, 12)
    assert seconds > 0 and [len(o) for o in outputs] == [12] * 4
    assert outputs[0] == outputs[2] and outputs[1] == outputs[3], "greedy: the same prompt, the same tokens"


def test_report_gives_ratios_and_first_divergence_from_fp32():
    base = {"format": "fp32", "tokens_per_s_b1": 10.0, "tokens_per_s_b4": 30.0, "perplexity": 9.0,
            "peak_rss_mib": 900, "greedy_tokens": [1, 2, 3]}
    int4 = base | {"format": "int4", "tokens_per_s_b1": 25.0, "greedy_tokens": [1, 2, 4]}
    bf16 = base | {"format": "bf16", "tokens_per_s_b1": 12.0}
    text = weights.report([base, bf16, int4], 4)
    assert "2.50x" in text and "differs at 2" in text and "identical" in text
    assert weights.first_divergence([1, 2], [1, 2, 3]) == 2


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        weights.main(["--formats", "fp32,int3"])
    assert exc.value.code == 2 and "--formats: unknown int3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        weights.main(["--streams", "0"])
    assert "--streams must be at least 1" in capsys.readouterr().err


def test_the_shipped_prompts_and_text_load():
    conversations = weights.load_prompts()
    assert len(conversations) >= 8 and all(c[1]["role"] == "user" and c[1]["content"] for c in conversations)
    assert len(weights.PERPLEXITY_FILE.read_text().split()) > 500
