"""Structured outputs: a request's JSON schema, regex, choice or grammar compiled into a matcher that
masks the logits of every step (see docs/architecture.md)."""
