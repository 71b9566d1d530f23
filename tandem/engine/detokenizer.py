"""Incremental detokenization that never splits a multi-byte character.

Decode a short window of ids twice, with and without the newest tokens, and emit only the
difference, waiting while the window ends in an incomplete UTF-8 sequence (U+FFFD). A few
prompt tokens seed the window so the first output token gets its leading space right.
"""

from __future__ import annotations

_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD),
        so the full text equals decoding all the tokens."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )
