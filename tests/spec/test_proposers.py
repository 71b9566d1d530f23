"""The n-gram proposer, the backoff every proposer uses, and --speculative-config parsing.
Pure Python and numpy."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.spec.config import SpeculativeConfig
from tandem.spec.ngram import NgramProposer, ngram_lookup
from tandem.spec.proposer import Backoff, ProposeRow


def lookup(tokens, n_min=2, n_max=4, k=3):
    return ngram_lookup(np.array(tokens), n_min, n_max, k).tolist()


def test_lookup_guesses_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    assert lookup([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]
    # two earlier occurrences: the latest wins
    assert lookup([1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3]) == [8, 1, 2]


def test_lookup_prefers_the_longest_suffix():
    # "2 3" last followed by 6, but "1 2 3" (longer) by 4
    assert lookup([1, 2, 3, 4, 9, 2, 3, 6, 1, 2, 3]) == [4, 9, 2]


def test_lookup_finds_nothing_below_the_shortest_n_or_without_a_continuation():
    assert lookup([1, 2, 3, 4, 5, 6, 3]) == []  # only a 1-gram repeats; n_min is 2
    assert lookup([5, 6], n_min=1) == []
    assert lookup([1, 2, 3, 1, 2], k=5) == [3, 1, 2]  # the guess stops at the known tokens


def proposer_step(p: NgramProposer, req: Request, new: list[int], drafted: int = 0):
    guess = p.propose([ProposeRow(req, new, drafted)]).get(req.request_id, [])
    req.all_token_ids += new
    return guess


def test_ngram_proposer_tracks_each_requests_tokens_across_steps():
    req = Request("a", [10, 11, 12, 13, 14, 10], SamplingParams())
    p = NgramProposer(3, 2, 4)
    assert proposer_step(p, req, [11]) == [12, 13, 14]  # "10 11" seen before
    assert proposer_step(p, req, [12, 13, 14], drafted=3) == [10, 11, 12]
    p.forget(["a"])
    assert p._history == {} and p._backoff == {}


def test_backoff_grows_on_full_acceptance_and_pauses_after_misses_in_a_row():
    b = Backoff(8)
    assert b.allowed() == 8
    b.observe(8, 1)
    assert b.allowed() == 2  # what was accepted, plus one
    b.observe(2, 2)
    assert b.allowed() == 4  # doubled
    b.observe(4, 0)
    b.observe(2, 0)
    assert b.allowed() == 1  # halved twice, no pause yet
    b.observe(1, 0)  # a third miss in a row: pause
    assert [b.allowed() for _ in range(3)] == [0, 0, 1]
    b.observe(1, 0)
    assert [b.allowed() for _ in range(5)] == [0, 0, 0, 0, 1]  # the pause doubles
    for _ in range(10):
        b.observe(1, 0)
    assert b.pause == 16  # up to max_pause
    b.pause = 0
    b.observe(1, 1)
    assert b.allowed() == 2 and b.misses == 0


def test_speculative_config_parses_vllm_json():
    c = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    )
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (
        "ngram",
        5,
        3,
        2,
    )
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == (
        "draft_model"
    )
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == (
        "ngram"
    )
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    "value, field",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5},
            "prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown field"),
    ],
)
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)
