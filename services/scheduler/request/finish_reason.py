"""How a request ended: one enum from the core's stop checks to the protobuf edge."""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    """A str enum: a reason equals its name in the API's lowercase spelling ("length")."""

    LENGTH = "length"
    """max_tokens generated, or the sequence filled max_model_len."""
    STOP = "stop"
    """One of stop_token_ids was generated, or the text reached a stop string."""
    EOS = "eos"
    """The model generated one of its EOS tokens (and ignore_eos was off)."""
    ABORT = "abort"
    """The client cancelled."""
    ERROR = "error"
    """Serving the request failed."""
