"""Incremental detokenization with stop strings.

Decoding only a short window of recent tokens keeps each step O(1) per request; a delta is released
only when it does not end in U+FFFD (an incomplete UTF-8 sequence that the next token completes), and
up to len(longest stop string) - 1 characters are held back so that a stop string is never streamed.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text of one request's output tokens, released in safe deltas."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.num_emitted = 0  # characters of `text` already released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int) -> bool:
        """Append a token; True if a stop string now appears (the text is cut before it)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            # A stop string not found before must end inside `new`, so it starts at or after this.
            search_from = max(0, len(self.text) - self.hold)
            self.text += new
            hits = [at for at in (self.text.find(s, search_from) for s in self.stop) if at != -1]
            if hits:
                self.text = self.text[:min(hits)]
                return True
        return False

    def delta(self, finished: bool) -> str:
        """Text not yet released; while unfinished, keeps back what could still start a stop string."""
        end = len(self.text) if finished else max(self.num_emitted, len(self.text) - self.hold)
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out
