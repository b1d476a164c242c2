"""The engine's greedy continuations are token for token those of Hugging Face ``generate()``.

transformers is the test-only reference: it loads the same directory and decodes greedily
(``do_sample=False``) for 128 new tokens with EOS disabled, as the engine does with
``ignore_eos``. Logit parity (test_model_parity.py) bounds the error of one forward; this
checks that nothing in the serving path (scheduling, the paged cache across many blocks,
sampling, the detokenizer's token bookkeeping) changes what is generated.

On a mismatch the message gives the first differing position and the reference's top-2
logit gap there, so a genuine bug (large gap) is told apart from an fp32 near-tie.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from tests.helpers.parity_specs import PARITY_SPECS
from tests.helpers.engine_runs import generate_all

NEW_TOKENS = 128
GREEDY = SamplingParams(temperature=0.0)
RUN_TO_LENGTH = StopConditions(max_tokens=NEW_TOKENS, ignore_eos=True)
STORY_PROMPTS = [None, "Once upon a time", "Tom and his dog went to the park"]


def make_engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu", num_blocks=128)))


def load_reference(model_dir: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # generate() stops a row at EOS even when given eos_token_id=None (it falls back to the
    # model's generation config), so clear it there to match ignore_eos.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def reference_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """New token ids from generate(); prompts of one length share a batch, so no padding is involved."""
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    outputs: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for length, rows in by_length.items():
            ids = torch.tensor([prompts[i] for i in rows])  # [B, length]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS)  # [B, length + NEW_TOKENS]
            for row, i in enumerate(rows):
                outputs[i] = out[row, length:].tolist()
    return outputs


def describe_divergence(model, prompt: list[int], ours: list[int], ref: list[int]) -> str:
    if len(ours) != len(ref):
        return f"engine produced {len(ours)} tokens, transformers {len(ref)}"
    k = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:k]])).logits[0, -1]  # [V]
    top = logits.topk(2)
    gap = (top.values[0] - top.values[1]).item()
    return (f"first difference at output token {k}: engine {ours[k]}, transformers {ref[k]}; "
            f"transformers' top-2 there {top.indices.tolist()} with logit gap {gap:.3e}")


def assert_same_generations(engine: Engine, model, prompts) -> None:
    prompt_ids = [engine.encode_prompt(p) for p in prompts]
    ours = [d.token_ids for d in generate_all(engine, prompts, GREEDY, RUN_TO_LENGTH)]
    refs = reference_greedy(model, prompt_ids)
    for prompt, mine, ref in zip(prompt_ids, ours, refs):
        assert len(ref) == NEW_TOKENS
        assert mine == ref, f"prompt {prompt[:8]}...: {describe_divergence(model, prompt, mine, ref)}"


@pytest.fixture(scope="module")
def stories(stories_dir):
    return make_engine(stories_dir), load_reference(stories_dir)


def test_stories260k_from_bos_matches_transformers(stories):
    engine, model = stories
    assert engine.encode_prompt(None) == [1]
    assert_same_generations(engine, model, [None])


def test_stories260k_text_prompts_match_transformers(stories):
    engine, model = stories
    assert_same_generations(engine, model, STORY_PROMPTS[1:])


def test_stories260k_text_is_the_decoded_tokens(stories):
    """The merged text equals decoding the generated ids after the prompt, with no token lost."""
    engine, _ = stories
    (out,) = generate_all(engine, [STORY_PROMPTS[1]], GREEDY, RUN_TO_LENGTH)
    prompt = engine.encode_prompt(STORY_PROMPTS[1])
    full = engine.tokenizer.decode(prompt + out.token_ids)
    assert full == engine.tokenizer.decode(prompt) + out.text
    assert out.finish_reason == "length" and out.usage.completion_tokens == NEW_TOKENS


@pytest.mark.parametrize("name", sorted(PARITY_SPECS))
def test_random_model_generations_match_transformers(random_model_dirs, name):
    model_dir = random_model_dirs[name]
    gen = torch.Generator().manual_seed(11)
    # Ids from 3 up: no BOS/EOS/UNK inside the prompts.
    prompts = torch.randint(3, PARITY_SPECS[name].vocab_size, (4, 11), generator=gen).tolist()
    assert_same_generations(make_engine(model_dir), load_reference(model_dir), prompts)
