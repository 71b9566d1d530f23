"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the context's last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) and guess that what followed it
then follows now. Free to compute, and right whenever the output copies its input (edits,
summaries quoting the source, code). Numpy over each request's token array, which grows in
place, so a step costs a few vector compares per request, not Python per token."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tandem.spec.proposer import Backoff, ProposeRow


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length in [n_min, n_max]; empty when there is none."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # window i is tokens[i : i + n] with at least one token after it (i + n < length)
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


class _History:
    """A request's tokens as a numpy array with room to grow."""

    def __init__(self, tokens: list[int]) -> None:
        self.buf = np.array(tokens, dtype=np.int64)
        self.n = len(tokens)

    def extend(self, tokens: list[int]) -> None:
        need = self.n + len(tokens)
        if need > len(self.buf):
            self.buf = np.resize(self.buf, max(need, 2 * len(self.buf)))
        self.buf[self.n : need] = tokens
        self.n = need

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.n]


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = num_speculative_tokens, n_min, n_max
        self._history: dict[str, _History] = {}
        self._backoff: dict[str, Backoff] = {}

    def propose(self, rows: list[ProposeRow]) -> dict[str, list[int]]:
        drafts = {}
        for row in rows:
            rid = row.request.request_id
            backoff = self._backoff.setdefault(rid, Backoff(self.k))
            backoff.observe(row.num_drafted, row.num_accepted)
            history = self._sync(rid, row)
            k = backoff.allowed()
            if k:
                guess = ngram_lookup(history.tokens, self.n_min, self.n_max, k)
                if guess.size:
                    drafts[rid] = guess.tolist()
        return drafts

    def _sync(self, rid: str, row: ProposeRow) -> _History:
        """The request's tokens after this step, kept from step to step (tokens only grow)."""
        known = row.request.all_token_ids
        history = self._history.get(rid)
        if history is None or history.n > len(known):
            history = self._history[rid] = _History(known)
        else:
            history.extend(known[history.n :])
        history.extend(row.new_token_ids)
        return history

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._history.pop(rid, None)
            self._backoff.pop(rid, None)
