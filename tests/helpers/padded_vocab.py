"""stories260K with its config vocab padded to 1,024 rows past its tokenizer's 512 ids
(services/tools/padded_vocab.py): a runner that does not mask the padded rows samples them."""

from __future__ import annotations

from pathlib import Path

from services.tools.padded_vocab import pad_vocab
from tests.helpers.service_harness import STORIES_DIR

TOKENIZER_VOCAB = 512
"""stories260K's tokenizer: ids [0, 512)."""


def padded_vocab_model(out: Path, vocab_size: int = 2 * TOKENIZER_VOCAB) -> Path:
    return pad_vocab(STORIES_DIR, out, vocab_size)
