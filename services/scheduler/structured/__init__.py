"""Structured outputs at admission: a request's StructuredOutput compiled to a checked grammar."""
