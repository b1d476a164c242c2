"""llama2.c -> Hugging Face conversion of stories260K: tokenizer parity, weights, determinism.

References: sentencepiece on the original tok512.model (tokenizer), a from-scratch numpy forward
pass of llama2.c's model read straight from the .bin (weights and the rotary permutation),
transformers' LlamaForCausalLM on the shipped directory (the thing under test).
"""

from __future__ import annotations

import hashlib
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from services.tools.llama2c import convert_llama2c, main
from services.tools.llama2c_tokenizer import (
    WhitespaceHandling,
    build_tokenizer,
    check_sentencepiece_model,
    read_llama2c_tokenizer,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "models" / "stories260K"
# The llama2.c originals, with their provenance (SOURCE.txt) and licence, ship as a test fixture:
# a clone of the repository converts and checks the model with nothing beside it.
SOURCE_DIR = REPO / "tests" / "fixtures" / "llama2c-stories260K"
SOURCE_FILES = ("stories260K.bin", "tok512.bin", "tok512.model")

# Greedy continuation of BOS, 64 tokens, as produced by the numpy llama2.c reference below.
EXPECTED_GREEDY_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high.\nLily"
)


def recorded_sha256(source_note: Path) -> dict[str, str]:
    """file name -> sha256, from the provenance table of SOURCE.txt."""
    recorded = {}
    for line in source_note.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0] in SOURCE_FILES and len(fields[2]) == 64:
            recorded[fields[0]] = fields[2]
    return recorded


def test_conversion_inputs_ship_with_the_repository():
    # The tests below must run from a clone alone, with no shared data folder beside it.
    assert SOURCE_DIR.is_relative_to(REPO)
    recorded = recorded_sha256(SOURCE_DIR / "SOURCE.txt")
    assert sorted(recorded) == sorted(SOURCE_FILES)
    for name in SOURCE_FILES:
        assert hashlib.sha256((SOURCE_DIR / name).read_bytes()).hexdigest() == recorded[name], name
    assert "MIT" in (SOURCE_DIR / "LICENSE").read_text()


@pytest.fixture(scope="module")
def source_dir() -> Path:
    return SOURCE_DIR


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    # tokenizer.model is a byte copy of tok512.model (its sha256 is recorded in PROVENANCE.md).
    return spm.SentencePieceProcessor(model_file=str(SHIPPED / "tokenizer.model"))


@pytest.fixture(scope="module")
def hf_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))


# ------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------

FIXED_TEXTS = [
    "",
    " ",
    "Once upon a time, there was a little girl named Lily.",
    "Hello, world! (yes?) -- 'quoted' \"double\"; a:b/c\\d [e] {f} <g> #1 @2 $3 %4 ^5 &6 *7 _8 =9 +0 |~`",
    "line one\nline two\n\nline four\n",
    "a  b   c    d",
    "   leading spaces",
    "trailing spaces   ",
    "  both  ",
    "tab\tseparated\tvalues\t",
    "\t leading tab",
    "digits 0123456789 and 3.14159 and 1,000,000",
    "你好，世界",
    "🙂🚀",
    "mixed: English, Français, Español, Deutsch, Русский, 日本語, 한국어, العربية, emoji 🙂!",
    "non-breaking\u00a0space and ideographic\u3000space",
    "zero\u200bwidth and\u200a hair space",
    "\u2581literal lower one eighth block\u2581",
    "\x00nul and \x7fdel",
]

RANDOM_ALPHABET = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list(" " * 12 + "\t\n.,;:!?'\"()-_/\\")
    + list("éñüçßøå你好世界日本語한국🙂🚀👍🏽\u00a0\u3000\u2581\u200b€™…—“”")
)


# Story words exercise long merge chains, where a wrong merge order shows.
RANDOM_WORDS = (
    "Once upon a time there was little girl boy named Lily Tom Ben Sue She He loved to play outside "
    "in the park One day saw big red ball wanted with it but too high happy sad friends together "
    "mom said yes no They were very and smiled went home dog cat tree sun"
).split()


def random_texts(count: int, seed: int) -> list[str]:
    """Half character soup over RANDOM_ALPHABET, half story words with random separators."""
    rng = random.Random(seed)
    texts = []
    for index in range(count):
        if index % 2:
            texts.append("".join(rng.choice(RANDOM_ALPHABET) for _ in range(rng.randint(0, 48))))
        else:
            words = [rng.choice(RANDOM_WORDS) for _ in range(rng.randint(1, 12))]
            texts.append("".join(word + rng.choice([" ", " ", " ", ", ", ". ", "  ", "\n", "!"]) for word in words))
    return texts


def assert_same_as_sentencepiece(text: str, sp: spm.SentencePieceProcessor, tokenizer: Tokenizer) -> None:
    expected = sp.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False).ids == expected, repr(text)
    assert tokenizer.encode(text).ids == sp.encode(text, add_bos=True), repr(text)  # add_bos_token: true
    assert tokenizer.decode(expected) == sp.decode(expected), repr(text)
    assert tokenizer.decode([1, *expected]) == sp.decode([1, *expected]), repr(text)


@pytest.mark.parametrize("text", FIXED_TEXTS)
def test_tokenizer_matches_sentencepiece_on_fixed_texts(text, sp, hf_tokenizer):
    assert_same_as_sentencepiece(text, sp, hf_tokenizer)


def test_tokenizer_matches_sentencepiece_on_random_texts(sp, hf_tokenizer):
    for text in random_texts(count=500, seed=20231):
        assert_same_as_sentencepiece(text, sp, hf_tokenizer)


def test_tokenizer_fixed_examples_are_exact(hf_tokenizer):
    # Pinned ids: story words merge, spaces squeeze, unknown characters fall back to UTF-8 bytes.
    assert hf_tokenizer.encode("Once upon a time").ids == [1, 403, 407, 261, 378]
    assert hf_tokenizer.encode("  a  b ", add_special_tokens=False).ids == [261, 268]
    assert hf_tokenizer.encode("🙂", add_special_tokens=False).ids == [410, 243, 162, 156, 133]
    assert hf_tokenizer.encode("").ids == [1]


def test_decode_of_generated_ids_matches_sentencepiece(sp, hf_tokenizer):
    # Model output is not always an encoding: runs of "▁" at the start, BOS/EOS in the middle.
    ascii_bytes = [3 + byte for byte in (*range(0x21, 0x7F), 0x09, 0x0A)]
    allowed = [1, 2, *range(259, 512), *ascii_bytes]
    rng = random.Random(7)
    for _ in range(300):
        ids = [410] * rng.randint(0, 3) + [rng.choice(allowed) for _ in range(rng.randint(0, 16))]
        assert hf_tokenizer.decode(ids) == sp.decode(ids), ids


def test_special_token_text_is_plain_text_only_with_encode_special_tokens(sp, hf_tokenizer):
    text = "<s>hi</s>"
    # tokenizers matches special tokens' text in the input by default (and gives "hi" its own
    # dummy prefix: "▁h" "i"); sentencepiece never does. Servers should set encode_special_tokens.
    assert hf_tokenizer.encode(text, add_special_tokens=False).ids == [1, 270, 417, 2]
    literal = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    literal.encode_special_tokens = True
    assert literal.encode(text, add_special_tokens=False).ids == sp.encode(text)


# ------------------------------------------------------------------------------------------
# weights: llama2.c reference forward pass (interleaved rotary), read straight from the .bin
# ------------------------------------------------------------------------------------------


def load_llama2c(path: Path) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    data = path.read_bytes()
    names = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    cfg = dict(zip(names, struct.unpack_from("<7i", data, 0)))
    assert cfg["vocab_size"] > 0, "reference handles the shared-classifier layout only"
    dim, hidden, layers = cfg["dim"], cfg["hidden_dim"], cfg["n_layers"]
    kv_dim = cfg["n_kv_heads"] * dim // cfg["n_heads"]
    floats = np.frombuffer(data, dtype="<f4", offset=28).astype(np.float64)
    shapes = {
        "emb": (cfg["vocab_size"], dim), "rms_att": (layers, dim), "wq": (layers, dim, dim),
        "wk": (layers, kv_dim, dim), "wv": (layers, kv_dim, dim), "wo": (layers, dim, dim),
        "rms_ffn": (layers, dim), "w1": (layers, hidden, dim), "w2": (layers, dim, hidden),
        "w3": (layers, hidden, dim), "rms_final": (dim,),
    }  # fmt: skip
    weights, offset = {}, 0
    for name, shape in shapes.items():
        weights[name] = floats[offset : offset + int(np.prod(shape))].reshape(shape)
        offset += int(np.prod(shape))
    return cfg, weights


def rms_norm(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * gain


def rotate_interleaved(x: np.ndarray) -> np.ndarray:
    """llama2.c's rotary: x [T, heads, head_dim]; pair (2i, 2i+1) turns by pos * 10000^(-2i/head_dim)."""
    seq, _, head_dim = x.shape
    angle = np.arange(seq)[:, None] * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)  # [T, hd/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def reference_logits(cfg: dict[str, int], w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits [T, vocab] in float64, one layer at a time like llama2.c's run.c (but batched over T)."""
    seq, heads, kv_heads = len(tokens), cfg["n_heads"], cfg["n_kv_heads"]
    head_dim = cfg["dim"] // heads
    causal = np.triu(np.full((seq, seq), -np.inf), 1)
    x = w["emb"][tokens]  # [T, dim]
    for layer in range(cfg["n_layers"]):
        h = rms_norm(x, w["rms_att"][layer])
        q = rotate_interleaved((h @ w["wq"][layer].T).reshape(seq, heads, head_dim))
        k = rotate_interleaved((h @ w["wk"][layer].T).reshape(seq, kv_heads, head_dim))
        v = (h @ w["wv"][layer].T).reshape(seq, kv_heads, head_dim)
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim) + causal  # [H, T, T]
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", probs, v).reshape(seq, -1) @ w["wo"][layer].T
        h = rms_norm(x, w["rms_ffn"][layer])
        gate = h @ w["w1"][layer].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["w3"][layer].T)) @ w["w2"][layer].T
    return rms_norm(x, w["rms_final"]) @ w["emb"].T  # shared classifier


@pytest.fixture(scope="module")
def reference(source_dir):
    return load_llama2c(source_dir / "stories260K.bin")


@pytest.fixture(scope="module")
def reference_greedy(reference) -> list[int]:
    cfg, weights = reference
    tokens = [1]
    for _ in range(64):
        tokens.append(int(reference_logits(cfg, weights, tokens)[-1].argmax()))
    return tokens


@pytest.fixture(scope="module")
def hf_model() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()


def test_hf_logits_match_llama2c_reference(reference, reference_greedy, hf_model):
    cfg, weights = reference
    rng = random.Random(3)
    # The story the model writes (40 tokens), then 40 arbitrary ids: both must agree everywhere.
    for tokens in (reference_greedy[:40], [1] + [rng.randrange(3, 512) for _ in range(39)]):
        expected = reference_logits(cfg, weights, tokens)
        with torch.no_grad():
            actual = hf_model(torch.tensor([tokens])).logits[0].double().numpy()
        assert actual.shape == expected.shape == (40, 512)
        assert np.abs(actual - expected).max() / np.abs(expected).max() < 1e-4


def test_hf_greedy_continuation_matches_reference(reference_greedy, hf_model, sp, hf_tokenizer):
    with torch.no_grad():
        generated = hf_model.generate(torch.tensor([[1]]), max_new_tokens=64, do_sample=False)[0].tolist()
    assert generated == reference_greedy
    assert sp.decode(generated) == EXPECTED_GREEDY_TEXT
    assert hf_tokenizer.decode(generated) == EXPECTED_GREEDY_TEXT


# ------------------------------------------------------------------------------------------
# determinism and bad input
# ------------------------------------------------------------------------------------------


def test_reconversion_is_byte_identical_to_shipped(source_dir, tmp_path):
    out_dir = tmp_path / "stories260K"  # same name: PROVENANCE.md records the command
    status = main(
        [
            "--checkpoint", str(source_dir / "stories260K.bin"),
            "--tokenizer", str(source_dir / "tok512.bin"),
            "--sentencepiece-model", str(source_dir / "tok512.model"),
            "--source-note", str(source_dir / "SOURCE.txt"),
            "--out", str(out_dir),
        ]
    )  # fmt: skip
    assert status == 0
    shipped = sorted(path.name for path in SHIPPED.iterdir())
    assert sorted(path.name for path in out_dir.iterdir()) == shipped
    assert shipped == [
        "PROVENANCE.md", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
    ]  # fmt: skip
    for name in shipped:
        assert (out_dir / name).read_bytes() == (SHIPPED / name).read_bytes(), name


def test_truncated_checkpoint_names_expected_and_actual_size(source_dir, tmp_path):
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes((source_dir / "stories260K.bin").read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"file size is 1056440 bytes, .* implies 1056540 bytes"):
        convert_llama2c(truncated, source_dir / "tok512.bin", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tokenizer_from_another_model_is_rejected(source_dir, tmp_path):
    tokenizer = (source_dir / "tok512.bin").read_bytes()
    extra_piece = struct.pack("<fi", -253.0, 1) + b"Q"
    (tmp_path / "tok513.bin").write_bytes(tokenizer + extra_piece)
    with pytest.raises(ValueError, match="9 trailing bytes after 512 pieces"):
        convert_llama2c(source_dir / "stories260K.bin", tmp_path / "tok513.bin", tmp_path / "out")


# ------------------------------------------------------------------------------------------
# the tokenizer builder beyond tok512: both whitespace settings, on freshly trained models
# ------------------------------------------------------------------------------------------


def export_llama2c_tokenizer(sp: spm.SentencePieceProcessor, path: Path) -> None:
    """What llama2.c's `tokenizer.py export` writes."""
    records = []
    for token_id in range(sp.get_piece_size()):
        piece = {sp.bos_id(): "\n<s>\n", sp.eos_id(): "\n</s>\n"}.get(token_id, sp.id_to_piece(token_id))
        data = piece.replace("▁", " ").encode("utf-8")
        records.append(struct.pack("<fi", sp.get_score(token_id), len(data)) + data)
    path.write_bytes(struct.pack("<i", max(len(r) - 8 for r in records)) + b"".join(records))


@pytest.mark.parametrize("remove_extra_whitespaces", [True, False])
def test_builder_matches_sentencepiece_models_trained_here(remove_extra_whitespaces, tmp_path):
    rng = random.Random(11)
    corpus = [text for text in random_texts(600, seed=5) if text.strip()] + [" ".join(RANDOM_WORDS) * 3]
    corpus += ["  ".join(rng.sample(RANDOM_WORDS, 6)) + "   " for _ in range(200)]  # space runs
    model = tmp_path / "tok.model"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(tmp_path / "tok"), model_type="bpe", vocab_size=400,
        character_coverage=1.0, byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=remove_extra_whitespaces,
        self_test_sample_size=0, minloglevel=2,
    )  # fmt: skip
    trained = spm.SentencePieceProcessor(model_file=str(model))
    export_llama2c_tokenizer(trained, tmp_path / "tok.bin")

    vocab = read_llama2c_tokenizer(tmp_path / "tok.bin", trained.get_piece_size())
    whitespace = check_sentencepiece_model(model, vocab)
    assert whitespace == WhitespaceHandling(remove_extra_whitespaces=remove_extra_whitespaces)
    if not remove_extra_whitespaces:  # the case the squeezing normalizer would get wrong
        assert any(piece.startswith("▁▁") for piece in vocab.pieces)
        with pytest.raises(ValueError, match="remove_extra_whitespaces"):
            build_tokenizer(vocab)
    tokenizer = build_tokenizer(vocab, whitespace)
    for text in FIXED_TEXTS + random_texts(300, seed=99):
        assert_same_as_sentencepiece(text, trained, tokenizer)
