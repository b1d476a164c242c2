"""The token ids a request may name: those both the executor and the detokenizer know.

The executor reports the ids its model may sample (services/runtime/model/vocab.py); a
tokenizer service pointed at other files may know fewer. An id past the tokenizer's would
reach a detokenizer that cannot make text of it, so prompts, logit_bias, stop ids and drafts
are checked against the smaller of the two.
"""

from __future__ import annotations

import dataclasses

from services.common.step import ExecutorInfo


def servable_info(info: ExecutorInfo, tokenizer_vocab_size: int | None) -> ExecutorInfo:
    """``info`` with vocab_size cut to the tokenizer's when it is smaller (None or 0: unknown)."""
    if tokenizer_vocab_size and tokenizer_vocab_size < info.vocab_size:
        return dataclasses.replace(info, vocab_size=tokenizer_vocab_size)
    return info
