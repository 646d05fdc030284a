"""Errors the front end raises about the engine core itself, not about one request."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process is gone (crashed, killed or shut down); its message says why.

    Once raised by a client, every later call on that client raises it too: nothing is retried.
    """
