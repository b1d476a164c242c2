"""The executor's grammar matchers: one per constrained sequence, and the token masks they give.

A constrained sequence (``SamplingParams.grammar``, compiled and checked by the scheduler)
holds an llguidance matcher that has consumed exactly its output tokens; before each draw the
matcher's bitmask of allowed next tokens (one bit per vocabulary id, 32 to an int32 word)
goes to the sampler, which sets the logits of disallowed ids to -inf (token_mask.py).

Why here and not in the scheduler: the executor samples, and with overlapped or multi-step
scheduling it knows a sequence's last token a step before the scheduler does, so only it can
mask the next draw without a round trip. The matcher therefore lives beside the sequence:

- a new sequence's matcher starts from a pristine copy of its grammar's (cached by content,
  so a shared schema is parsed once per executor; built with its first mask by ``prepare``
  when the scheduler admits the request, beside the step thread) and consumes the outputs the
  sequence already has: after a preemption by recompute the scheduler resends them, and the matcher
  is where it was;
- each sampled token is consumed once drawn;
- with speculation, the masks of the k + 1 positions come from the matcher advanced through
  the drafts one at a time and rolled back (llguidance's draft-token fill): a draft the
  grammar forbids at its position cannot equal the masked target there, so it is rejected
  exactly where a plain decode would have diverged; the emitted tokens are consumed after.

Masks of a batch are filled by llguidance's thread pool in one call (it releases the GIL).
Every matcher runs under the parser limits the scheduler compiled its grammar under
(services/common/grammar_limits.py), so no mask costs more than admission allowed. A matcher
that fails (at a limit, or refusing a token) puts its sequence's request to an end with an
error (``failure``; the model runner reports it in the sequence's output); until the scheduler
ends it, a row whose mask would allow nothing allows the model's EOS ids, so its draw is
defined.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
import threading
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from services.common.grammar_limits import parser_limits

TEMPLATE_CACHE_SIZE = 64

class MaskFuture:
    """A batch's masks being filled (or already known): ``result()`` waits for them."""

    __slots__ = ("_future", "_value")

    def __init__(self, future: Future | None = None, value: Any = None) -> None:
        self._future = future
        self._value = value

    def result(self) -> Any:
        return self._future.result() if self._future is not None else self._value


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


class GrammarMatchers:
    """The model's vocabulary as llguidance sees it, the pristine matcher of each recent
    grammar, and the batch mask fill. Built on first use (reading the vocabulary takes ~0.4 s)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        """Guards the templates and the vocabulary's build: ``prepare`` runs beside the step."""
        self._worker: ThreadPoolExecutor | None = None

    def submit(self, fill: Callable[[list], Any], rows: list) -> MaskFuture:
        """``fill(rows)`` on the mask worker thread, beside the forward, when some row is
        constrained; None at once when none is. Even one row's mask is worth the hand-off: a
        JSON schema's mask costs 0.3-0.8 ms a step on SmolLM2's vocabulary, against a 5 ms
        step, and filled beside the forward the batch-1 decode ran at 0.92-0.95x unconstrained
        instead of 0.88-0.89x on this thread (python -m benchmarks structured, docs/benchmarks.md)."""
        if not any(state.matcher is not None for state, _ in rows):
            return MaskFuture(value=None)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return MaskFuture(self._worker.submit(fill, rows))

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            with self._lock:
                return self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            path = self.model_dir / "tokenizer.json"
            if not path.is_file():
                raise ValueError(f"structured output needs the model's tokenizer.json; {path} does not exist")
            self._tokenizer = llguidance.LLTokenizer(str(path), n_vocab=self.vocab_size,
                                                     eos_token=list(self.eos_token_ids) or None)
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def prepare(self, grammar: str) -> str:
        """Build ``grammar``'s template and its first mask now, off the step thread (the
        scheduler asks at admission); "" when ready, else why it cannot run. The mask's lexer
        states stay with the template, so a sequence's copy finds them built."""
        with self._lock:
            if grammar in self._templates:
                return ""
        try:
            template = self._build(grammar)
        except ValueError as exc:
            return str(exc)
        mask = np.zeros((1, bitmask_words(self.vocab_size)), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(template, mask, 0)  # leaves the template where it was
        if template.is_error():
            return self.failure(template)
        self._keep(grammar, template)
        return ""

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        if template.is_error():
            raise ValueError(f"structured output failed: the grammar does not build: "
                             f"{_first_line(template.get_error())}")
        return template

    def _keep(self, grammar: str, template: llguidance.LLMatcher) -> None:
        with self._lock:
            self._templates[grammar] = template
            while len(self._templates) > TEMPLATE_CACHE_SIZE:
                self._templates.popitem(last=False)

    def matcher(self, grammar: str, output_ids: Sequence[int]) -> llguidance.LLMatcher:
        """A matcher for ``grammar`` that has consumed ``output_ids``. Raises ValueError when
        the grammar does not build or the outputs do not follow it."""
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
        if template is None:  # not prepared (or evicted since): built in the step
            template = self._build(grammar)
            self._keep(grammar, template)
        matcher = template.deep_copy()
        if output_ids and not matcher.consume_tokens(list(output_ids)):
            raise ValueError(f"structured output failed: the sequence's outputs do not follow its grammar: "
                             f"{_first_line(matcher.get_error())}")
        return matcher

    def fill(self, rows: int, entries: list[tuple[llguidance.LLMatcher, int, list[int]]]) -> np.ndarray:
        """[rows, words] int32 masks: for each (matcher, row, drafts), row ``row`` gets the
        mask at the matcher's position and rows ``row + 1 ..`` those after each draft in turn
        (the matcher is rolled back after). Rows no entry names allow everything."""
        mask = np.full((rows, bitmask_words(self.vocab_size)), -1, dtype=np.int32)
        plain = [(m, row) for m, row, drafts in entries if not drafts]
        drafted = [(m, row, drafts) for m, row, drafts in entries if drafts]
        self.tokenizer  # noqa: B018 - builds the executor with the vocabulary
        if len(plain) == 1:  # one matcher: on this thread, no pool hand-off
            llguidance.numpy.fill_next_token_bitmask(plain[0][0], mask, plain[0][1])
        elif plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, mask)
        if drafted:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, mask)
        empty = ~mask.any(axis=1)
        if empty.any():
            mask[empty] = 0
            for token_id in self.eos_token_ids:
                mask[empty, token_id // 32] |= np.int32(np.uint32(1 << (token_id % 32)).view(np.int32))
        return mask

    @staticmethod
    def failure(matcher: llguidance.LLMatcher) -> str:
        """The error a failed matcher ends its request with."""
        return f"structured output failed: {_first_line(matcher.get_error())}"

    @staticmethod
    def advance(matcher: llguidance.LLMatcher, token_ids: Sequence[int]) -> None:
        """Consume drawn tokens. A refusal leaves the matcher in its error state, which the
        model runner reports as the sequence's failure after the step. A matcher whose grammar
        is complete has stopped and its mask allowed only EOS: the draw ends the sequence, and
        there is nothing to consume."""
        if not matcher.is_stopped():
            matcher.consume_tokens(list(token_ids))


def _first_line(message: str) -> str:
    """llguidance's message without the parser state it may append."""
    return message.strip().split("\n", 1)[0]
