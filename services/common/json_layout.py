"""How constrained JSON is written: one layout for every schema, wherever a grammar embeds one.

llguidance's JSON compile options. No free whitespace, so a small model cannot wander into
endless newlines inside an object and every value has one spelling; compact separators (as
``json.dumps(separators=(",", ":"))``): the fewest tokens, and no forced space after a token
boundary, which llguidance's masks get wrong for Metaspace tokenizers without a lone-space
token (stories260K's: the mask after ``":"`` let a digit through that the matcher refused). The scheduler's grammar compiler applies them to a request's JSON schema and
the gateway to the schemas it embeds in a tool-call grammar (``x-guidance``).
"""

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
