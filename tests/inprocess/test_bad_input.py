"""Bad model directories and bad requests fail at once, with a message naming the problem.

Model directories are refused at load (unknown architecture, missing or misshaped tensor,
pickle-only weights); requests are refused by ``Engine.add_request`` before anything is
queued, and a refused request leaves the engine serving the next one normally.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.runtime.model.config import ModelConfig
from services.tools.random_model import PRESETS, build_random_model
from services.runtime.model.weights import find_safetensors_files, load_checkpoint
from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from tests.helpers.engine_runs import generate_all


def make_engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu", num_blocks=64)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_random_model(PRESETS["tiny"], tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def model_copy(tiny_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


def rewrite_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---------------------------------------------------------------------------- model directories


def test_unknown_architecture_is_named(model_copy):
    config_path = model_copy / "config.json"
    raw = json.loads(config_path.read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_model_dir(model_copy)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        make_engine(model_copy)


def test_missing_tensor_is_named(model_copy):
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_tensors(model_copy, lambda t: t.pop(name))
    config = ModelConfig.from_model_dir(model_copy)
    with pytest.raises(ValueError, match=re.escape(f"missing tensor(s): {name}")):
        load_checkpoint(model_copy, config, torch.float32)
    with pytest.raises(ValueError, match=re.escape(name)):
        make_engine(model_copy)


def test_misshaped_tensor_names_tensor_and_both_shapes(model_copy):
    name = "model.layers.0.self_attn.k_proj.weight"  # tiny: 2 KV heads x 16 dims over hidden 64

    def transpose(tensors):
        tensors[name] = tensors[name].t().contiguous()

    rewrite_tensors(model_copy, transpose)
    config = ModelConfig.from_model_dir(model_copy)
    expected = re.escape(f"tensor '{name}' in model.safetensors has shape (64, 32), expected (32, 64)")
    with pytest.raises(ValueError, match=expected):
        load_checkpoint(model_copy, config, torch.float32)
    with pytest.raises(ValueError, match=expected):
        make_engine(model_copy)


def test_pickle_only_directory_is_refused_without_unpickling(model_copy):
    (model_copy / "model.safetensors").unlink()
    # Not a valid pickle: the refusal must come from the file name, never from loading it.
    (model_copy / "pytorch_model.bin").write_bytes(b"not a pickle; must never be opened")
    with pytest.raises(ValueError, match=r"only pickle weight files \(pytorch_model\.bin\).*safetensors only"):
        find_safetensors_files(model_copy)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors only"):
        make_engine(model_copy)


def test_directory_without_weights_is_refused(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weight files"):
        make_engine(model_copy)


# ---------------------------------------------------------------------------- requests


@pytest.fixture(scope="module")
def engine(stories_dir) -> Engine:
    engine = make_engine(stories_dir)
    assert engine.info.max_model_len == 512 and engine.info.vocab_size == 512
    return engine


def test_prompt_longer_than_the_context_names_length_and_limit(engine):
    with pytest.raises(ValueError, match=r"prompt length 600 .* below max_model_len=512"):
        engine.add_request([1] * 600)
    # Exactly the limit leaves no room for an output token.
    with pytest.raises(ValueError, match=r"prompt length 512 .* below max_model_len=512"):
        engine.add_request([1] * 512)


def test_max_tokens_beyond_the_context(engine):
    with pytest.raises(ValueError, match=r"max_tokens 600 must be below the context limit 512"):
        engine.add_request("Once", stop=StopConditions(max_tokens=600))
    with pytest.raises(ValueError, match=r"prompt length 500 \+ max_tokens=100 = 600 exceeds max_model_len=512"):
        engine.add_request([1] * 500, stop=StopConditions(max_tokens=100))


@pytest.mark.parametrize("temperature", [-0.5, float("nan"), float("inf"), 1e308])
def test_negative_nan_or_unbounded_temperature(engine, temperature):
    message = r"temperature must be in \[0, 100\] \(0 = greedy\), got " + re.escape(str(temperature))
    with pytest.raises(ValueError, match=message):
        engine.add_request("Once", SamplingParams(temperature=temperature))


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5])
def test_top_p_outside_zero_one(engine, top_p):
    with pytest.raises(ValueError, match=re.escape(f"top_p must be in (0, 1], got {top_p}")):
        engine.add_request("Once", SamplingParams(top_p=top_p))


@pytest.mark.parametrize("bad_id", [512, 100000, -1])
def test_token_id_outside_the_vocabulary(engine, bad_id):
    with pytest.raises(ValueError, match=re.escape(f"prompt_token_ids[2] = {bad_id} is outside [0, 512)")):
        engine.add_request([1, 300, bad_id, 301])


def test_refused_requests_leave_nothing_behind(engine):
    for bad in ([1] * 600, [1, 512]):
        with pytest.raises(ValueError):
            engine.add_request(bad)
    assert not engine.has_unfinished()
    (out,) = generate_all(engine, ["Once upon a time"], SamplingParams(temperature=0.0),
                                 StopConditions(max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
