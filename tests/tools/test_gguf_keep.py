"""``tokenmill convert gguf --weights keep``: Q4_1/Q4_0/Q8_0 tensors stored as they are, run by the
quantized linears, equal to the dequantized (fp32) conversion of the same file.

The kept model holds the same numbers as the fp32 conversion (each weight is d * q (+ m) either
way) and the CPU kernel multiplies them in fp32, so logits agree within 1e-4 of the logit scale
and greedy text is identical. A tiny synthetic GGUF always runs; SmolLM2 (the PyPI package's
Q4_1 file) runs in the slow tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.runtime.model.quant.linear import QuantLinear
from services.tokenizer.text_service import TextService
from services.tools.gguf import convert_gguf
from services.tools.quantize import quantize_model
from tests.helpers.quant_models import write_dequantized
from tests.tools.gguf_helpers import assert_close_to_reference, engine_logits, load_engine_model, write_tiny_llama_gguf

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("tiny-keep")
    source = root / "tiny.gguf"
    write_tiny_llama_gguf(source, untied=True)
    convert_gguf(source, root / "keep", weights="keep")
    convert_gguf(source, root / "fp32", weights="fp32")
    return source, root / "keep", root / "fp32"


def test_keep_stores_the_files_blocks_and_says_so(tiny_pair):
    source, keep, _ = tiny_pair
    quant = json.loads((keep / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "tokenmill", "format": "q4_1", "group_size": 32,
                     "modules": {"lm_head": "q8_0", "model.embed_tokens": "q8_0"}}
    state = load_file(str(keep / "model.safetensors"))
    reader = GGUFReader(source)
    v = next(t for t in reader.tensors if t.name == "blk.1.attn_v.weight")  # no q/k row permutation
    blocks = np.asarray(v.data).reshape(int(v.shape[1]), -1, 20)  # Q4_1 block: d, m (fp16), 16 value bytes
    assert np.array_equal(state["model.layers.1.self_attn.v_proj.qweight"].numpy(), blocks[:, :, 4:].reshape(len(blocks), -1))
    assert np.array_equal(state["model.layers.1.self_attn.v_proj.mins"].numpy().view(np.uint8).reshape(len(blocks), -1, 2),
                          blocks[:, :, 2:4])
    assert state["model.norm.weight"].dtype == torch.float32


def test_keep_model_equals_the_fp32_conversion(tiny_pair):
    _, keep, fp32 = tiny_pair
    model = load_engine_model(keep)
    assert all(m.path == "cpu_kernel" for m in model.modules() if isinstance(m, QuantLinear))
    assert isinstance(model.lm_head, QuantLinear)  # untied Q8_0 output.weight kept
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_close_to_reference(engine_logits(model, ids), engine_logits(fp32, ids))


# --- SmolLM2-135M-Instruct --------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_keep(smollm2_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-keep") / "model"
    convert_gguf(smollm2_gguf, out, weights="keep")
    return out


@pytest.mark.slow
def test_smollm2_keep_is_the_files_q4_1_and_q8_0(smollm2_keep, smollm2_dir):
    quant = json.loads((smollm2_keep / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "q4_1" and quant["modules"] == {"model.embed_tokens": "q8_0"}
    # 4.5 + 1 bits per projection weight plus the Q8_0 embedding: under a fifth of the fp32 file
    assert (smollm2_keep / "model.safetensors").stat().st_size < 0.2 * (smollm2_dir / "model.safetensors").stat().st_size


@pytest.mark.slow
def test_smollm2_keep_logits_equal_fp32_conversion(smollm2_keep, smollm2_dir):
    text = TextService(smollm2_keep)
    kept, fp32 = load_engine_model(smollm2_keep), load_engine_model(smollm2_dir)
    for messages in CONVERSATIONS:
        ids = text.render_chat(messages).token_ids
        assert_close_to_reference(engine_logits(kept, ids), engine_logits(fp32, ids))


@pytest.mark.slow
def test_smollm2_keep_greedy_text_equals_fp32_conversion(smollm2_keep, smollm2_dir):
    prompts = [TextService(smollm2_keep).render_chat(m).token_ids for m in CONVERSATIONS]
    outputs = []
    for model_dir in (smollm2_keep, smollm2_dir):
        engine = Engine(EngineConfig(ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu",
                                                    num_blocks=64, max_model_len=1024, quant_activations="none")))
        texts = [""] * len(prompts)
        for i, delta in engine.generate(prompts, SamplingParams(temperature=0.0), StopConditions(max_tokens=64)):
            texts[i] += delta.text
        outputs.append(texts)
    assert outputs[0][0].startswith("The capital of France is Paris")
    assert outputs[0] == outputs[1]


@pytest.fixture(scope="module")
def smollm2_int8(smollm2_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("smollm2-int8")
    quantize_model(smollm2_dir, root / "int8", "int8")
    return root / "int8", write_dequantized(root / "int8", root / "dequantized")


@pytest.mark.slow
def test_smollm2_int8_equals_its_dequantized_twin(smollm2_int8):
    """tokenmill quantize --weights int8 of SmolLM2: logits within 1e-4 and greedy text identical
    against the fp32 model holding the same (dequantized) numbers."""
    quant_dir, float_dir = smollm2_int8
    text = TextService(quant_dir)
    prompts = [text.render_chat(m).token_ids for m in CONVERSATIONS]
    quantized, dequantized = load_engine_model(quant_dir), load_engine_model(float_dir)
    assert all(m.path == "cpu_kernel" for m in quantized.modules() if isinstance(m, QuantLinear))
    for ids in prompts:
        assert_close_to_reference(engine_logits(quantized, ids), engine_logits(dequantized, ids))
    outputs = []
    for model_dir in smollm2_int8:
        engine = Engine(EngineConfig(ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu",
                                                    num_blocks=64, max_model_len=1024)))
        texts = [""] * len(prompts)
        for i, delta in engine.generate(prompts, SamplingParams(temperature=0.0), StopConditions(max_tokens=48)):
            texts[i] += delta.text
        outputs.append(texts)
    assert outputs[0] == outputs[1]
