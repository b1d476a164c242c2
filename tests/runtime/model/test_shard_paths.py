"""Shards named by model.safetensors.index.json stay inside the model directory: a name like
"../x.safetensors", an absolute path or a symlink pointing out is refused by name, before any
file is opened."""

from __future__ import annotations

import json

import pytest

from services.runtime.model.weights import find_safetensors_files


def index_dir(tmp_path, *names: str):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"w{i}": name for i, name in enumerate(names)}}))
    return model


def test_plain_shard_names_are_found(tmp_path):
    model = index_dir(tmp_path, "a.safetensors", "b.safetensors", "a.safetensors")
    for name in ("a.safetensors", "b.safetensors"):
        (model / name).write_bytes(b"")
    assert find_safetensors_files(model) == [model / "a.safetensors", model / "b.safetensors"]


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ""])
def test_names_that_leave_the_directory_are_refused(tmp_path, name):
    (tmp_path / "outside.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="shards must be plain file names in the model directory"):
        find_safetensors_files(index_dir(tmp_path, name))


def test_a_symlink_out_of_the_directory_is_refused(tmp_path):
    (tmp_path / "outside.safetensors").write_bytes(b"")
    model = index_dir(tmp_path, "link.safetensors")
    (model / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ValueError, match="'link.safetensors', which leads out of the model directory"):
        find_safetensors_files(model)
