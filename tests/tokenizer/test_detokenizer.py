"""IncrementalDetokenizer: streamed deltas add up to tokenizer.decode(output_ids), exactly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers.models import WordLevel

from services.common.detokenize import DetokenizeBatch, NewTextStream
from services.tokenizer.detokenizer import REPLACEMENT_CHAR, DetokenizerPool, IncrementalDetokenizer
from services.tokenizer.text_tokenizer import TextTokenizer
from tests.helpers.tiny_bpe import EOS_ID, FIRST_BYTE_ID, LLAMA_CONFIG, byte_level_style, llama_style, metaspace_style, write_model_dir

STORIES260K = Path(__file__).resolve().parents[2] / "models" / "stories260K"
MULTIBYTE = ["中", "文", "語", "🐶", "🚀", "é", "ï", "ß", "한", "👍🏽", "€"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, TextTokenizer]:
    root = tmp_path_factory.mktemp("tok")
    built = {
        "llama": TextTokenizer.from_dir(write_model_dir(root / "llama", llama_style(), LLAMA_CONFIG)),
        "metaspace": TextTokenizer.from_dir(write_model_dir(root / "metaspace", metaspace_style(), LLAMA_CONFIG)),
        "byte_level": TextTokenizer.from_dir(write_model_dir(root / "byte_level", byte_level_style(), {"eos_token": "</s>"})),
        "stories260K": TextTokenizer.from_dir(STORIES260K),  # the default model: byte fallback, 512 pieces
    }
    return built


@pytest.fixture(scope="module")
def llama(tokenizers) -> TextTokenizer:
    return tokenizers["llama"]


def byte_ids(tok: TextTokenizer, text: str) -> list[int]:
    return [FIRST_BYTE_ID + b for b in text.encode("utf-8")]


def stream(tok: TextTokenizer, prompt: list[int], output: list[int], chunks: list[int], **kwargs) -> list[str]:
    """Deltas of `output` appended in chunks of the given sizes (cycled), then finish()."""
    skip = kwargs.get("skip_special_tokens", True)
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    full = tok.decode(output, skip_special_tokens=skip)
    deltas: list[str] = []
    pos, i = 0, 0
    while pos < len(output):
        size = chunks[i % len(chunks)]
        deltas.append(detok.append(output[pos : pos + size]))
        pos += size
        i += 1
        emitted = "".join(deltas)
        if not kwargs.get("keep_leading_space"):
            assert full.startswith(emitted), (output[:pos], emitted, full)
    deltas.append(detok.finish())
    return deltas


def random_output(rng: random.Random, tok: TextTokenizer, length: int) -> list[int]:
    """Normal tokens mixed with specials, valid multi-byte characters and stray bytes."""
    bytes_ = sorted(tok.byte_token_ids)
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.5:
            ids.append(rng.randrange(tok.vocab_size))
        elif kind < 0.6:
            ids.append(rng.choice(sorted(tok.skipped_special_ids)))
        elif kind < 0.85:
            char = rng.choice(MULTIBYTE)
            ids.extend(byte_ids(tok, char) if bytes_ else tok.encode(char, add_special_tokens=False))
        elif bytes_:
            ids.append(rng.choice(bytes_))
    return ids


@pytest.mark.parametrize("style", ["llama", "metaspace", "byte_level", "stories260K"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_random_sequences_add_up_to_the_full_decode(tokenizers, style, skip_special):
    tok = tokenizers[style]
    rng = random.Random(f"{style}-{skip_special}")
    for _ in range(60):
        output = random_output(rng, tok, rng.randrange(1, 40))
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        full = tok.decode(output, skip_special_tokens=skip_special)
        for chunks in ([1], [rng.randrange(1, 6) for _ in range(5)], [len(output)]):
            deltas = stream(tok, prompt, output, chunks, skip_special_tokens=skip_special)
            assert "".join(deltas) == full
            if REPLACEMENT_CHAR not in full:
                assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize("style", ["llama", "metaspace", "byte_level", "stories260K"])
def test_encoded_cjk_and_emoji_stream_without_replacement_chars(tokenizers, style):
    tok = tokenizers[style]
    rng = random.Random(7)
    texts = ["中文🐶 naïve", "Once upon a time 🚀🚀 there was 한국어.", "👍🏽€ß", "日本語のテキスト", "a 中 b 🐶 c"]
    for text in texts:
        output = tok.encode(text, add_special_tokens=False)
        full = tok.decode(output)
        assert REPLACEMENT_CHAR not in full
        for chunks in ([1], [2, 3], [rng.randrange(1, 5) for _ in range(7)]):
            deltas = stream(tok, tok.encode("Hello"), output, chunks)
            assert "".join(deltas) == full
            assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas


def test_a_character_is_emitted_once_its_byte_run_ends(llama):
    a = llama.token_to_id("▁a")
    detok = IncrementalDetokenizer(llama, [])
    assert [detok.append([i]) for i in byte_ids(llama, "中")] == ["", "", ""]
    assert detok.append([a]) == "中 a"
    assert detok.finish() == ""


def test_a_stray_byte_invalidates_the_whole_run_as_the_full_decode_does(llama):
    run = byte_ids(llama, "中") + [FIRST_BYTE_ID + 0x80]
    assert llama.decode(run) == REPLACEMENT_CHAR * 4  # ByteFallback: all or nothing per run
    detok = IncrementalDetokenizer(llama, [])
    assert [detok.append([i]) for i in run] == ["", "", "", ""]
    assert detok.finish() == REPLACEMENT_CHAR * 4


def test_byte_run_continues_across_a_skipped_special_token(llama):
    e4, b8, ad = byte_ids(llama, "中")
    detok = IncrementalDetokenizer(llama, [])
    assert detok.append([e4, EOS_ID]) == ""
    assert detok.append([b8]) == ""
    assert detok.append([ad, EOS_ID]) == ""
    assert detok.append([llama.token_to_id("!")]) == "中!"


def test_incomplete_sequence_at_the_end_is_flushed_as_replacement_chars(llama):
    output = [llama.token_to_id("▁a")] + byte_ids(llama, "中")[:2]
    detok = IncrementalDetokenizer(llama, [])
    assert [detok.append([i]) for i in output] == ["a", "", ""]
    assert detok.finish() == REPLACEMENT_CHAR * 2 == llama.decode(output)[1:]


def test_byte_level_holds_an_incomplete_character_until_it_completes(tokenizers):
    tok = tokenizers["byte_level"]
    dog = tok.encode("🐶", add_special_tokens=False)
    assert len(dog) == 2 and tok.decode(dog[:1]).endswith(REPLACEMENT_CHAR)
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.append([i]) for i in dog] == ["", "🐶"]


def test_first_output_token_space_follows_the_full_decode(llama):
    prompt = llama.encode("Once upon a time")
    output = llama.encode("there was a dog", add_special_tokens=False)
    assert [llama.id_to_token(i) for i in output] == ["▁there", "▁was", "▁a", "▁dog"]
    # Decoding each token alone would lose every space: "there", "was", ...
    assert stream(llama, prompt, output, [1]) == ["there", " was", " a", " dog", ""]
    assert llama.decode(output) == "there was a dog"


def test_keep_leading_space_continues_the_prompt_text(llama):
    prompt = llama.encode("Once upon a time")
    output = llama.encode("there was a dog", add_special_tokens=False)
    deltas = stream(llama, prompt, output, [1], keep_leading_space=True)
    assert deltas == [" there", " was", " a", " dog", ""]
    assert "".join(deltas) == llama.decode(prompt + output)[len(llama.decode(prompt)) :]


@pytest.mark.parametrize("style", ["llama", "metaspace", "byte_level", "stories260K"])
def test_keep_leading_space_random_outputs_continue_the_prompt(tokenizers, style):
    tok = tokenizers[style]
    rng = random.Random(style)
    prompts = ["Once upon a time", "He was a big dog and", "x y z ! 42", "中文 the"]
    for _ in range(40):
        prompt = tok.encode(rng.choice(prompts))
        output = random_output(rng, tok, rng.randrange(1, 30))
        deltas = stream(tok, prompt, output, [rng.randrange(1, 4)], keep_leading_space=True)
        assert "".join(deltas) == tok.decode(prompt + output)[len(tok.decode(prompt)) :]


def test_keep_leading_space_decodes_the_output_alone_when_the_prompt_ends_mid_character(llama):
    prompt = llama.encode("a") + byte_ids(llama, "中")[:1]
    output = byte_ids(llama, "中")[1:] + [llama.token_to_id("▁a")]
    assert "".join(stream(llama, prompt, output, [1], keep_leading_space=True)) == llama.decode(output)


def test_a_lone_space_piece_keeps_its_space(tokenizers):
    # "▁had" "▁" "▁upon": the window after "had" starts with the lone "▁"; decoded on its own, the
    # decoder's leading-space strip ate that space and the stream said "had upon".
    tok = tokenizers["stories260K"]
    output = [381, 410, 407]
    assert [tok.id_to_token(i) for i in output] == ["▁had", "▁", "▁upon"]
    assert tok.decode(output) == "had  upon"
    assert stream(tok, [], output, [1]) == ["had", " ", " upon", ""]
    prompt = tok.encode("Once upon a time")
    deltas = stream(tok, prompt, output, [1], keep_leading_space=True)
    assert deltas == [" had", " ", " upon", ""]
    assert "".join(deltas) == tok.decode(prompt + output)[len(tok.decode(prompt)) :]


def test_a_run_of_space_pieces_streams_every_space(tokenizers):
    tok = tokenizers["stories260K"]
    output = [381, 410, 410, 410, 407, 410]
    assert tok.decode(output) == "had    upon "
    for chunks in ([1], [2], [3], [1, 2]):
        assert "".join(stream(tok, [], output, chunks)) == "had    upon "


def test_a_prompt_without_text_leaves_the_start_rule_to_the_output(tokenizers):
    # BOS alone has no text: the output starts the text and loses its leading space(s), as in
    # decode(prompt + output). stories260K strips every leading "▁", the llama style only one, so
    # a prompt "▁" (no text either) leaves the output's own space in place there.
    stories, llama = tokenizers["stories260K"], tokenizers["llama"]
    for prompt in ([1], [1, 410], [], [410, 410]):
        output = [410, 381, 410, 407]
        deltas = stream(stories, prompt, output, [1], keep_leading_space=True)
        assert "".join(deltas) == stories.decode(prompt + output) == "had  upon", prompt
    space, the = llama.token_to_id("▁"), llama.token_to_id("▁the")
    assert "".join(stream(llama, [1], [the], [1], keep_leading_space=True)) == "the"
    assert llama.decode([1, space, the]) == " the"
    assert "".join(stream(llama, [1, space], [the], [1], keep_leading_space=True)) == " the"


def test_without_an_anchor_windows_are_decoded_plainly(tmp_path):
    # A vocabulary where no token decodes alone to plain text: no anchor, the vLLM windows alone.
    pieces = ["<unk>", "▁", "▁▁"]
    bare = Tokenizer(WordLevel({piece: i for i, piece in enumerate(pieces)}, unk_token="<unk>"))
    bare.add_special_tokens([AddedToken("<unk>", special=True, normalized=False)])
    bare.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok = TextTokenizer.from_dir(write_model_dir(tmp_path, bare, {"unk_token": "<unk>"}))
    assert tok.anchor_token_id is None and tok.anchor_text == ""
    output = [2, 1, 0, 2]
    assert "".join(stream(tok, [], output, [1])) == tok.decode(output) == "   "  # token 0 loses all its "▁"


def test_an_eos_id_that_is_a_normal_token_is_decoded_as_text(tmp_path):
    # generation_config may list stop ids that tokenizer.json does not mark special; decode keeps them.
    bang = llama_style().token_to_id("!")
    tok = TextTokenizer.from_dir(write_model_dir(tmp_path, llama_style(), LLAMA_CONFIG, {"eos_token_id": [2, bang]}))
    assert bang in tok.eos_token_ids and bang not in tok.skipped_special_ids
    output = [tok.token_to_id("▁a"), bang, EOS_ID]
    assert stream(tok, [], output, [1]) == ["a", "!", "", ""]
    assert tok.decode(output) == "a!"


def test_special_tokens_are_skipped_or_kept(llama):
    output = [llama.token_to_id("▁Once"), EOS_ID, llama.token_to_id("▁upon"), EOS_ID]
    assert stream(llama, [], output, [1]) == ["Once", "", " upon", "", ""]
    kept = stream(llama, [], output, [1], skip_special_tokens=False)
    assert "".join(kept) == llama.decode(output, skip_special_tokens=False) == "Once</s> upon</s>"


class CountingTokenizer:
    """Delegates to a TextTokenizer and counts the ids each decode call is given."""

    def __init__(self, inner: TextTokenizer) -> None:
        self.inner = inner
        self.decoded_ids = 0
        self.skipped_special_ids = inner.skipped_special_ids
        self.byte_token_ids = inner.byte_token_ids
        self.anchor_token_id = inner.anchor_token_id
        self.anchor_text = inner.anchor_text

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


def test_work_per_token_does_not_grow_with_the_sequence(llama):
    rng = random.Random(3)
    words = llama.encode("Once upon a time there was a big dog and you", add_special_tokens=False)
    output = [rng.choice(words) for _ in range(3000)]
    counting = CountingTokenizer(llama)
    detok = IncrementalDetokenizer(counting, [])  # type: ignore[arg-type]
    text = "".join(detok.append([i]) for i in output) + detok.finish()
    assert text == llama.decode(output)
    # Per token: the window (anchor, context token, new token), then the next context (anchor, token).
    assert counting.decoded_ids <= 5 * len(output)
    assert len(detok._window) <= 2


def test_a_long_byte_run_is_decoded_once(llama):
    output = byte_ids(llama, "中文" * 500)
    counting = CountingTokenizer(llama)
    detok = IncrementalDetokenizer(counting, [])  # type: ignore[arg-type]
    assert all(detok.append([i]) == "" for i in output)
    assert counting.decoded_ids == 0
    assert detok.finish() == "中文" * 500
    assert counting.decoded_ids == len(output)


def test_append_after_finish_is_an_error(llama):
    detok = IncrementalDetokenizer(llama, [])
    detok.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        detok.append([5])


def test_pool_interleaves_streams_like_separate_detokenizers(llama):
    rng = random.Random(11)
    outputs = {sid: random_output(rng, llama, 30) for sid in (1, 2, 3)}
    pool = DetokenizerPool(llama, max_streams=3)
    texts = {sid: "" for sid in outputs}
    pool.apply(DetokenizeBatch([NewTextStream(sid, llama.encode("Hi"), skip_special_tokens=sid != 2)
                                for sid in outputs]))
    longest = max(map(len, outputs.values()))
    for pos in range(longest):
        last = pos == longest - 1
        appended = [(sid, output[pos : pos + 1]) for sid, output in outputs.items() if pos < len(output)]
        closed = [sid for sid, output in outputs.items() if pos == len(output) - 1]
        result = pool.apply(DetokenizeBatch(appended=appended, closed=closed))
        assert not result.stopped
        for sid, text in result.texts.items():
            texts[sid] += text
        assert last or len(pool) == 3 - len([o for o in outputs.values() if len(o) <= pos + 1])
    for sid in outputs:
        assert texts[sid] == llama.decode(outputs[sid], skip_special_tokens=sid != 2)
    assert len(pool) == 0


def test_pool_fails_a_bad_stream_alone_naming_the_field_and_the_limit(llama):
    pool = DetokenizerPool(llama, max_streams=2)
    ids = llama.encode("the cat sat", add_special_tokens=False)
    pool.apply(DetokenizeBatch([NewTextStream(7, [])]))
    # Each bad item fails its own stream; stream 5, in the same batches, is served as usual.
    result = pool.apply(DetokenizeBatch([NewTextStream(5, []), NewTextStream(7, [])], appended=[(5, ids[:1])]))
    assert result.failed == {7: "new_streams[1].stream_id 7 is already open"}
    assert 7 not in pool  # two requests claimed it: both are dropped
    text = result.texts[5]
    result = pool.apply(DetokenizeBatch([NewTextStream(8, []), NewTextStream(9, [])], appended=[(5, ids[1:2])]))
    assert result.failed == {9: "too many open streams: the limit max_streams is 2"}
    text += result.texts[5]
    result = pool.apply(DetokenizeBatch([NewTextStream(3, [llama.vocab_size]), NewTextStream(4, [], ("",))],
                                        appended=[(6, [5]), (8, [llama.vocab_size + 3]), (5, ids[2:])]))
    assert result.failed == {
        3: f"new_streams[0].prompt_token_ids holds {llama.vocab_size}, outside the vocabulary [0, {llama.vocab_size})",
        4: "new_streams[1].stop[0] is empty; stop strings must be non-empty",
        6: "stream_ids names 6, which is not open",
        8: f"token_ids of stream 8 holds {llama.vocab_size + 3}, outside the vocabulary [0, {llama.vocab_size})",
    }
    assert 8 not in pool and 3 not in pool and 4 not in pool
    text += result.texts[5] + pool.apply(DetokenizeBatch(appended=[(5, [])], closed=[5])).texts[5]
    assert text == llama.decode(ids)
    pool.apply(DetokenizeBatch(closed=[5]))  # idempotent: a stop and an abort may both close one
    assert len(pool) == 0


def _pieces_text(llama, ids):
    return llama.decode(ids, skip_special_tokens=True)


def test_pool_cuts_the_text_at_a_stop_string_across_tokens_and_closes_the_stream(llama):
    ids = llama.encode("the cat sat on the mat", add_special_tokens=False)
    full = _pieces_text(llama, ids)
    pool = DetokenizerPool(llama)
    pool.apply(DetokenizeBatch([NewTextStream(1, [], stop=("sat on",)), NewTextStream(2, [], stop=("sat on",),
                                                                                      include_stop_str_in_output=True)]))
    texts = {1: "", 2: ""}
    stopped = {}
    for token in ids:
        result = pool.apply(DetokenizeBatch(appended=[(sid, [token]) for sid in (1, 2) if sid in pool]))
        for sid, text in result.texts.items():
            texts[sid] += text
        stopped.update(result.stopped)
    assert stopped == {1: "sat on", 2: "sat on"}
    assert texts == {1: full[:full.index("sat on")], 2: full[:full.index("sat on") + len("sat on")]}
    assert len(pool) == 0  # a stopped stream is closed by the pool itself


def test_pool_releases_text_held_for_a_stop_string_when_the_stream_closes(llama):
    ids = llama.encode("the cat", add_special_tokens=False)
    pool = DetokenizerPool(llama)
    pool.apply(DetokenizeBatch([NewTextStream(1, [], stop=("cat and",))]))
    text = ""
    for position, token in enumerate(ids):
        last = position == len(ids) - 1
        result = pool.apply(DetokenizeBatch(appended=[(1, [token])], closed=[1] if last else []))
        text += result.texts[1]
        assert not result.stopped
        if not last:
            assert "cat" not in text  # may begin the stop string: held
    assert text == _pieces_text(llama, ids) and len(pool) == 0
