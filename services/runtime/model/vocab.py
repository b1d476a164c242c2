"""How many token ids a model may sample: the rows of its LM head that its tokenizer names.

Checkpoints often pad the embedding and the LM head past the tokenizer (Qwen2-family configs
say 151,936 rows, their tokenizer has 151,665 ids) so the matrices divide evenly for kernels.
The padded rows are never trained toward zero: a sampler that sees them draws ids now and
then that no tokenizer can turn into text. The runner masks every row from
``sampled_vocab_size`` on and reports that size as the model's vocabulary, so the scheduler
checks prompts, biases and stop ids against it too.
"""

from __future__ import annotations

import json
from pathlib import Path


def tokenizer_vocab_size(model_dir: str | Path) -> int | None:
    """One past the largest id of ``tokenizer.json`` in ``model_dir`` (its model's vocabulary
    and its added tokens); None when the directory has no tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = (data.get("model") or {}).get("vocab") or {}
    # BPE, WordPiece and WordLevel map piece -> id; Unigram lists [piece, score] by id.
    largest = max(vocab.values(), default=-1) if isinstance(vocab, dict) else len(vocab) - 1
    for added in data.get("added_tokens") or ():
        largest = max(largest, int(added["id"]))
    return largest + 1 if largest >= 0 else None


def sampled_vocab_size(model_dir: str | Path, config_vocab_size: int) -> int:
    """The ids the model may produce: the config's rows, cut to the tokenizer's ids when it has fewer."""
    tokenizer = tokenizer_vocab_size(model_dir)
    return config_vocab_size if tokenizer is None else min(config_vocab_size, tokenizer)
