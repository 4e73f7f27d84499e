"""Incremental detokenization with stop strings.

Decoding only a short window of recent tokens keeps each step O(1) per request; a delta is released
only when it does not end in U+FFFD (an incomplete UTF-8 sequence that the next token completes), and
up to len(longest stop string) - 1 characters are held back so that a stop string is never streamed.
The text is kept as the released pieces plus the pending rest, so a step appends to short strings only
(a growing `text += new` copies the whole output each step once an output object holds a reference);
the whole text is joined only when asked for (`text`, `snapshot`).
"""

from __future__ import annotations

from collections.abc import Callable


class IncrementalDetokenizer:
    """Text of one request's output tokens, released in safe deltas."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.released: list[str] = []  # text handed out by `delta`, in its pieces
        self._join_at = 64  # released pieces are joined into one when they reach this count
        self.pending = ""  # text not handed out yet: at least the last `hold` characters, until finished
        self.prefix_offset = 0
        self.read_offset = 0

    @property
    def text(self) -> str:
        """The text so far (joined: O(length))."""
        return "".join(self.released) + self.pending

    def snapshot(self) -> Callable[[], str]:
        """A function giving the text as it is now, joined only when called (a list of released pieces is
        only appended to, a join makes a new one; `pending` is an immutable string)."""
        released, num_pieces, pending = self.released, len(self.released), self.pending
        return lambda: "".join(released[:num_pieces]) + pending

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
            # A stop string not found before must end inside `new`, so it starts at or after this; and it
            # lies in `pending`, which holds back the last `hold` characters before `new`.
            search_from = max(0, len(self.pending) - self.hold)
            self.pending += new
            hits = [at for at in (self.pending.find(s, search_from) for s in self.stop) if at != -1]
            if hits:
                self.pending = self.pending[:min(hits)]
                return True
        return False

    def delta(self, finished: bool) -> str:
        """Text not yet released; while unfinished, keeps back what could still start a stop string."""
        end = len(self.pending) if finished else max(0, len(self.pending) - self.hold)
        out = self.pending[:end]
        if out:
            self.released.append(out)
            self.pending = self.pending[end:]
            if len(self.released) >= self._join_at:  # a string per step costs ~60 B of overhead: join them
                # when their count doubles (amortized O(1)); into a new list, so snapshots stay valid
                self.released = ["".join(self.released)]
                self._join_at *= 2
        return out
