"""Incremental detokenization of a streamed answer, as SGLang's detokenizer does it
(``DetokenizerManager``: decode from a surrogate offset before the read offset): each chunk
decodes only the ids since the last emitted boundary, so streaming an answer costs decoding it
about twice, not once per chunk over everything so far."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class IncrementalDecoder:
    """``decode``: token ids -> text. ``step`` gets all output ids so far and returns the text
    they add. A step whose text ends in U+FFFD (the ids stop inside a multi-byte character)
    returns "" and keeps those ids for the next step; the final step returns them anyway."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.prefix_offset = 0   # decoding starts here: a character boundary
        self.read_offset = 0     # the text of ids before this was returned

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        prefix = self.decode(ids[self.prefix_offset:self.read_offset])
        text = self.decode(ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return text[len(prefix):]
