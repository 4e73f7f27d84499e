"""Errors the engine raises to its callers, apart from ValueError (a request refused for its input)."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """The waiting queue has no room for these requests (`EngineConfig.max_num_waiting_seqs` and
    `max_num_waiting_tokens`); nothing was queued. Not the caller's fault: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s
