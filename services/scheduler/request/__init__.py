"""One request's state, from admission to its last delta: the core's ``Request`` (progress and
status), its ``StopConditions``, the ``RequestUpdate`` each step makes, the client's
``GenerationDelta`` and the ``RequestStream`` (the client side: its sink, text stream and what
it has been told) that turns one into the other, and the one
``FinishReason`` carried to the protobuf edge. Pure Python: no I/O, no clock, no torch."""
