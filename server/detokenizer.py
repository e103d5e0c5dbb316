"""Incremental detokenisation and stop strings for one request.

Re-decoding the whole output every step costs O(n) per token; the tokenizers library's
``DecodeStream`` turns each new id into its text piece in O(1), holding back bytes until they form
valid UTF-8. Text after a stop string is cut; while streaming, the last ``len(stop) - 1``
characters are held back since a stop string may still be completing.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


def backend(tokenizer):
    """The ``tokenizers.Tokenizer`` under a transformers fast tokenizer."""
    inner = getattr(tokenizer, "backend_tokenizer", None)
    if inner is None:
        raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer; the server needs one")
    return inner


def find_stop(text: str, stops: list[str], start: int) -> int:
    """Index in text of the earliest stop string that ends after ``start``, or -1."""
    hits = [text.find(s, max(0, start - len(s) + 1)) for s in stops]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else -1


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer (see ``backend``)
        self._stream = DecodeStream(skip_special_tokens=True)
        self.stop = stop
        self.holdback = max((len(s) - 1 for s in stop), default=0)
        self.text = ""
        self.emitted = 0  # characters of text already handed out

    def add(self, token_id: int) -> bool:
        """Append one token's text; True when a stop string ended the text (it is cut there)."""
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return False
        before = len(self.text)
        self.text += piece
        if self.stop:
            cut = find_stop(self.text, self.stop, before)
            if cut >= 0:
                self.text = self.text[:cut]
                return True
        return False

    def delta(self, finished: bool) -> str:
        """New text that is safe to hand out."""
        end = len(self.text) if finished else len(self.text) - self.holdback
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
