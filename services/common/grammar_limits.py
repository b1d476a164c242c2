"""The bounds every grammar runs within, wherever llguidance builds or steps one.

The scheduler compiles a request's grammar under these limits (services/scheduler/structured/)
and the executor builds its matchers under the same ones (services/runtime/sampling/grammar.py),
so a grammar the scheduler admitted never needs more work per step in the executor than it was
allowed at admission. llguidance's defaults are sized for a library user who trusts the grammar;
a server's callers are not trusted, so each is set here, lower, and explicitly:

- ``initial_lexer_fuel`` 200,000 (default 1,000,000; ~50k a ms): building the lexer's regex
  ASTs. At the default a 58-byte pattern of nested counted repeats built its first mask for
  0.9-1.7 s on this machine; at 200,000 the build stops in a few milliseconds.
- ``step_lexer_fuel`` 100,000 (default 200,000; ~14k a ms): one mask's lexer work, ~7 ms.
- ``step_max_items`` 20,000 (default 50,000; ~20k a ms): one mask's Earley items, ~1 ms.
- ``max_lexer_states`` 50,000 (default 250,000; 1-2 kB each): a matcher's lexer memory.
- ``max_grammar_size`` 200,000 symbols (default 500,000).
- ``max_items_in_row`` 2,000 (the default, stated).
- ``verbose_errors`` off: a refusal's message goes back to the client, and must not carry the
  parser's state or another part of the grammar.

A grammar that hits a limit puts its matcher in an error state (the executor then ends that
request with an error, never a silent stop); at admission it is refused with INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import Any

PARSER_LIMITS: dict[str, Any] = {
    "max_items_in_row": 2_000,
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 100_000,
    "step_max_items": 20_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 200_000,
    "precompute_large_lexemes": True,  # off, one such pattern took 30-40 s for its first mask
    "verbose_errors": False,
}


def parser_limits() -> Any:
    """``PARSER_LIMITS`` as llguidance's LLParserLimits (imported here only when used)."""
    import llguidance

    return llguidance.LLParserLimits(**PARSER_LIMITS)
