"""Convert a llama2.c checkpoint (+ tokenizer) into a Hugging Face Llama model directory.

    python -m services.tools.llama2c --checkpoint stories260K.bin --tokenizer tok512.bin \\
        --sentencepiece-model tok512.model --source-note SOURCE.txt --out models/stories260K

llama2.c's legacy (version 0) checkpoint is a header of seven int32 followed by fp32 arrays:

    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len   (vocab_size < 0: untied)
    token_embedding [vocab, dim]
    rms_att [L, dim]  wq [L, dim, dim]  wk [L, kv_dim, dim]  wv [L, kv_dim, dim]  wo [L, dim, dim]
    rms_ffn [L, dim]  w1 [L, hidden, dim]  w2 [L, dim, hidden]  w3 [L, hidden, dim]
    rms_final [dim]  freq_cis_real [seq_len, head_dim/2]  freq_cis_imag [seq_len, head_dim/2]
    wcls [vocab, dim]                                                       (only when untied)

Matrices are PyTorch Linear weights ([out, in], row major), so they map 1:1 to HF tensors except
for the rotary layout: llama2.c rotates adjacent pairs (2i, 2i+1) of each head, HF Llama rotates
(i, i + head_dim/2) ("rotate half"). Permuting the rows of q_proj and k_proj within each head
(even rows first, then odd rows) turns one into the other; q.k is unchanged because both sides get
the same permutation.

Output is deterministic: tensors in sorted order, JSON with sorted keys, no time stamps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from services.tools.llama2c_tokenizer import (
    BOS,
    EOS,
    UNK,
    WhitespaceHandling,
    build_tokenizer,
    check_sentencepiece_model,
    read_llama2c_tokenizer,
)

_HEADER = struct.Struct("<7i")
_FLOAT_BYTES = 4
# llama2.c's newer export formats (version 1/2) start with this magic instead of `dim`.
_EXPORT_MAGIC = 0x616B3432  # "ak42"
ROPE_THETA = 10000.0  # llama2.c hard-codes both in run.c
RMS_NORM_EPS = 1e-5
BOS_ID, EOS_ID = 1, 2


@dataclass(frozen=True, slots=True)
class Llama2cConfig:
    """The llama2.c checkpoint header."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool
    """True when the header's vocab_size is positive: the output layer reuses the embedding."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_header(cls, header: bytes) -> Llama2cConfig:
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = _HEADER.unpack(header)
        if dim == _EXPORT_MAGIC:
            raise ValueError(
                "checkpoint is llama2.c's version 1/2 export (magic 'ak42'); only the legacy format is read"
            )
        config = cls(dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(vocab_size), seq_len, vocab_size > 0)
        config.validate()
        return config

    def validate(self) -> None:
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"checkpoint header: {name} = {getattr(self, name)} must be positive")
        if self.dim % self.n_heads:
            raise ValueError(f"checkpoint header: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"checkpoint header: head_dim {self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"checkpoint header: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """llama2.c tensor names and shapes, in file order."""
        d, h, n, kv, v = self.dim, self.hidden_dim, self.n_layers, self.kv_dim, self.vocab_size
        shapes = {
            "token_embedding": (v, d),
            "rms_att": (n, d),
            "wq": (n, d, d),
            "wk": (n, kv, d),
            "wv": (n, kv, d),
            "wo": (n, d, d),
            "rms_ffn": (n, d),
            "w1": (n, h, d),
            "w2": (n, d, h),
            "w3": (n, h, d),
            "rms_final": (d,),
            "freq_cis_real": (self.seq_len, self.head_dim // 2),
            "freq_cis_imag": (self.seq_len, self.head_dim // 2),
        }
        if not self.shared_classifier:
            shapes["wcls"] = (v, d)
        return shapes

    def file_size(self) -> int:
        floats = sum(int(np.prod(shape)) for shape in self.tensor_shapes().values())
        return _HEADER.size + floats * _FLOAT_BYTES


def read_llama2c_checkpoint(path: Path) -> tuple[Llama2cConfig, dict[str, np.ndarray]]:
    """Parse a legacy llama2.c checkpoint into its header and fp32 arrays (llama2.c names)."""
    data = Path(path).read_bytes()
    if len(data) < _HEADER.size:
        raise ValueError(f"{path}: {len(data)} bytes, shorter than the {_HEADER.size}-byte llama2.c header")
    config = Llama2cConfig.from_header(data[: _HEADER.size])
    expected = config.file_size()
    if len(data) != expected:
        raise ValueError(
            f"{path}: file size is {len(data)} bytes, but the header ({config}) implies {expected} bytes"
        )
    weights: dict[str, np.ndarray] = {}
    offset = _HEADER.size
    for name, shape in config.tensor_shapes().items():
        count = int(np.prod(shape))
        weights[name] = np.frombuffer(data, dtype="<f4", count=count, offset=offset).reshape(shape)
        offset += count * _FLOAT_BYTES
    return config, weights


def interleaved_to_rotate_half(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the output rows of a q/k projection from llama2.c's rotary layout to HF's.

    weight: [n_heads * head_dim, dim]. Within each head, rows (0, 2, 4, ..., 1, 3, 5, ...): the
    pair (2i, 2i+1) rotated by llama2.c becomes the pair (i, i + head_dim/2) rotated by HF.
    """
    out_features, in_features = weight.shape
    head_dim = out_features // n_heads
    # [n_heads, head_dim/2, 2, dim] -> [n_heads, 2, head_dim/2, dim]
    per_head = weight.reshape(n_heads, head_dim // 2, 2, in_features).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(per_head.reshape(out_features, in_features))


def to_hf_state_dict(config: Llama2cConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Map llama2.c arrays to Hugging Face LlamaForCausalLM tensor names (freq_cis is dropped)."""
    state = {"model.embed_tokens.weight": weights["token_embedding"], "model.norm.weight": weights["rms_final"]}
    for i in range(config.n_layers):
        prefix = f"model.layers.{i}"
        state[f"{prefix}.input_layernorm.weight"] = weights["rms_att"][i]
        state[f"{prefix}.self_attn.q_proj.weight"] = interleaved_to_rotate_half(weights["wq"][i], config.n_heads)
        state[f"{prefix}.self_attn.k_proj.weight"] = interleaved_to_rotate_half(weights["wk"][i], config.n_kv_heads)
        state[f"{prefix}.self_attn.v_proj.weight"] = weights["wv"][i]
        state[f"{prefix}.self_attn.o_proj.weight"] = weights["wo"][i]
        state[f"{prefix}.post_attention_layernorm.weight"] = weights["rms_ffn"][i]
        state[f"{prefix}.mlp.gate_proj.weight"] = weights["w1"][i]
        state[f"{prefix}.mlp.down_proj.weight"] = weights["w2"][i]
        state[f"{prefix}.mlp.up_proj.weight"] = weights["w3"][i]
    if not config.shared_classifier:
        state["lm_head.weight"] = weights["wcls"]
    return {name: np.ascontiguousarray(state[name], dtype=np.float32) for name in sorted(state)}


def hf_config(config: Llama2cConfig) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.seq_len,
        "rope_theta": ROPE_THETA,
        "rms_norm_eps": RMS_NORM_EPS,
        "tie_word_embeddings": config.shared_classifier,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def tokenizer_config(config: Llama2cConfig) -> dict[str, object]:
    return {
        # Load tokenizer.json as written; Llama-specific classes rebuild their own normalizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": config.seq_len,
        "clean_up_tokenization_spaces": False,
    }


def _write_json(path: Path, payload: dict[str, object]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_table(paths: list[Path]) -> str:
    rows = ["| file | bytes | sha256 |", "|---|---:|---|"]
    rows += [f"| `{path.name}` | {path.stat().st_size} | `{_sha256(path)}` |" for path in paths]
    return "\n".join(rows)


def command_line(
    checkpoint: Path,
    tokenizer_bin: Path,
    out_dir: Path,
    sentencepiece_model: Path | None = None,
    source_note_file: Path | None = None,
) -> str:
    """The conversion command with bare file names, so the record does not depend on where it ran."""
    parts = [
        "python -m services.tools.llama2c",
        f"--checkpoint {checkpoint.name}",
        f"--tokenizer {tokenizer_bin.name}",
    ]
    if sentencepiece_model is not None:
        parts.append(f"--sentencepiece-model {sentencepiece_model.name}")
    if source_note_file is not None:
        parts.append(f"--source-note {source_note_file.name}")
    parts.append(f"--out {out_dir.name}")
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class ConversionRecord:
    """What PROVENANCE.md states about one conversion."""

    command: str
    inputs: tuple[Path, ...]
    outputs: tuple[Path, ...]
    config: Llama2cConfig
    whitespace: WhitespaceHandling
    whitespace_source: str
    source_note: str | None


def write_provenance(out_dir: Path, record: ConversionRecord) -> Path:
    config = record.config
    note = record.source_note.strip() if record.source_note else "No source note was given: origin and licence unrecorded."
    squeeze = "on" if record.whitespace.remove_extra_whitespaces else "off"
    text = f"""# Provenance of {out_dir.name}

Converted from a llama2.c checkpoint into a Hugging Face Llama directory by
`services/tools/llama2c.py`; file names stand for their paths:

```
{record.command}
```

## Inputs

{_file_table(record.inputs)}

## Origin and licence (source note, verbatim)

```
{note}
```

## What the conversion does

- Header: dim {config.dim}, hidden_dim {config.hidden_dim}, n_layers {config.n_layers}, n_heads {config.n_heads}, \
n_kv_heads {config.n_kv_heads}, vocab_size {config.vocab_size}, seq_len {config.seq_len}, \
{"shared" if config.shared_classifier else "separate"} classifier.
- Weights are copied bit for bit as fp32; only the rows of each q_proj/k_proj are reordered per head
  (llama2.c's interleaved rotary pairs -> Hugging Face rotate-half). freq_cis tables are dropped
  (rope_theta {ROPE_THETA}, rms_norm_eps {RMS_NORM_EPS}, llama2.c's constants).
- tokenizer.json is a BPE with byte fallback built from tokenizer.bin's pieces and scores; merges are
  ranked by the score of the merged piece, as sentencepiece BPE applies them. Ids 0/1/2 are named
  {UNK} / {BOS} / {EOS}. remove_extra_whitespaces is {squeeze} ({record.whitespace_source}).

## Outputs

{_file_table(record.outputs)}
"""
    path = out_dir / "PROVENANCE.md"
    path.write_text(text, encoding="utf-8")
    return path


def convert_llama2c(
    checkpoint: Path,
    tokenizer_bin: Path,
    out_dir: Path,
    sentencepiece_model: Path | None = None,
    source_note: str | None = None,
    *,
    command: str | None = None,
) -> Path:
    """Convert a llama2.c checkpoint and tokenizer into `out_dir`; returns `out_dir`.

    sentencepiece_model: the .model the tokenizer was exported from; checked against tokenizer.bin
        and copied as tokenizer.model. source_note: origin and licence text for PROVENANCE.md.
    command: the command line recorded in PROVENANCE.md (default: built from the file names).
    """
    checkpoint, tokenizer_bin, out_dir = Path(checkpoint), Path(tokenizer_bin), Path(out_dir)
    config, weights = read_llama2c_checkpoint(checkpoint)
    vocab = read_llama2c_tokenizer(tokenizer_bin, config.vocab_size)
    inputs = [checkpoint, tokenizer_bin]
    # tokenizer.bin does not record the normalizer; without the .model assume llama2.c's train_vocab.
    whitespace, whitespace_source = WhitespaceHandling(), "assumed: llama2.c train_vocab default"
    if sentencepiece_model is not None:
        sentencepiece_model = Path(sentencepiece_model)
        whitespace = check_sentencepiece_model(sentencepiece_model, vocab)
        whitespace_source = f"read from {sentencepiece_model.name}"
        inputs.append(sentencepiece_model)

    state_dict = to_hf_state_dict(config, weights)
    tokenizer = build_tokenizer(vocab, whitespace)

    out_dir.mkdir(parents=True, exist_ok=True)
    outputs = [out_dir / name for name in ("config.json", "generation_config.json", "model.safetensors")]
    _write_json(outputs[0], hf_config(config))
    # llama2.c's training data delimits stories with BOS, so its models end a story by emitting
    # BOS, never EOS; run.c stops there. Listing BOS among the end tokens keeps that behaviour.
    _write_json(outputs[1], {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, BOS_ID]})
    save_file(state_dict, str(outputs[2]), metadata={"format": "pt"})
    outputs.append(out_dir / "tokenizer.json")
    tokenizer.save(str(outputs[-1]), pretty=True)
    outputs.append(out_dir / "tokenizer_config.json")
    _write_json(outputs[-1], tokenizer_config(config))
    if sentencepiece_model is not None:
        outputs.append(out_dir / "tokenizer.model")
        shutil.copyfile(sentencepiece_model, outputs[-1])

    if command is None:
        command = command_line(checkpoint, tokenizer_bin, out_dir, sentencepiece_model)
    record = ConversionRecord(
        command, tuple(inputs), tuple(sorted(outputs)), config, whitespace, whitespace_source, source_note
    )
    write_provenance(out_dir, record)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.tools.llama2c",
        description="Convert a llama2.c checkpoint and tokenizer.bin into a Hugging Face Llama directory.",
    )
    parser.add_argument("--checkpoint", type=Path, required=True, help="llama2.c model .bin (legacy format)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="llama2.c tokenizer .bin")
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument(
        "--sentencepiece-model", type=Path, help="sentencepiece .model behind the tokenizer (checked, then copied)"
    )
    parser.add_argument(
        "--source-note", type=Path, help="text file with origin and licence, quoted in PROVENANCE.md"
    )
    args = parser.parse_args(argv)

    source_note = args.source_note.read_text(encoding="utf-8") if args.source_note else None
    command = command_line(args.checkpoint, args.tokenizer, args.out, args.sentencepiece_model, args.source_note)
    try:
        out_dir = convert_llama2c(
            args.checkpoint, args.tokenizer, args.out, args.sentencepiece_model, source_note, command=command
        )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
