"""Workload generators: a seed fixes every request; lengths stay in their ranges; prompts
meant to share a prefix share it token for token."""

from __future__ import annotations

import pytest

from tandem.bench import workloads as wl
from tandem.bench.workloads import LengthRange, RequestClass


@pytest.fixture(scope="module")
def tok(llama_path):
    from tandem.engine.tokenizer import load_tokenizer

    return load_tokenizer(llama_path)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_random_same_seed_same_requests_other_seed_others(tok):
    a = wl.random_workload(tok, 8, LengthRange(20, 40), LengthRange(5, 9), seed=3)
    b = wl.random_workload(tok, 8, LengthRange(20, 40), LengthRange(5, 9), seed=3)
    c = wl.random_workload(tok, 8, LengthRange(20, 40), LengthRange(5, 9), seed=4)
    assert a == b
    assert [s.requests[0].prompt for s in a] != [s.requests[0].prompt for s in c]


def test_random_lengths_in_range_and_counted_with_the_tokenizer(tok):
    inp, out = LengthRange.around(32, 0.5), LengthRange.around(10, 0.2)
    assert (inp.low, inp.high, out.low, out.high) == (16, 48, 8, 12)
    sessions = wl.random_workload(tok, 30, inp, out, seed=0)
    for s in sessions:
        (r,) = s.requests
        assert r.prompt_len == len(encode(tok, r.prompt))
        assert r.prompt_len in inp and r.output_len in out
    assert len({s.requests[0].prompt_len for s in sessions}) > 5  # the range is used


def test_shared_prefix_prompts_share_their_group_prefix_token_for_token(tok):
    sessions = wl.shared_prefix_workload(
        tok,
        12,
        groups=3,
        prefix_len=40,
        suffix_len=LengthRange(5, 15),
        output_len=LengthRange(4, 4),
    )
    assert sessions == wl.shared_prefix_workload(
        tok,
        12,
        groups=3,
        prefix_len=40,
        suffix_len=LengthRange(5, 15),
        output_len=LengthRange(4, 4),
    )
    by_group: dict[str, list[list[int]]] = {}
    for s in sessions:
        (r,) = s.requests
        ids = encode(tok, r.prompt)
        assert r.prompt_len == len(ids)
        by_group.setdefault(r.cls, []).append(ids)
    assert len(by_group) == 3
    prefixes = []
    for group in by_group.values():
        assert len(group) == 4
        first = group[0]
        shared = min(len(_common(first, ids)) for ids in group[1:])
        assert shared >= 40  # the whole prefix, token for token
        prefixes.append(first[:40])
    assert len({tuple(p) for p in prefixes}) == 3  # groups differ


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_multi_turn_resends_the_growing_history(tok):
    sessions = wl.multi_turn_workload(
        tok, 3, turns=4, user_len=LengthRange(8, 12), output_len=LengthRange(5, 7), seed=1
    )
    assert sessions == wl.multi_turn_workload(
        tok, 3, turns=4, user_len=LengthRange(8, 12), output_len=LengthRange(5, 7), seed=1
    )
    for s in sessions:
        assert len(s.requests) == 4
        prev = None
        for turn, r in enumerate(s.requests):
            ids = encode(tok, r.prompt)
            assert r.prompt_len == len(ids)
            assert [m["role"] for m in r.messages] == ["user", "assistant"] * turn + ["user"]
            assert "".join(m["content"] for m in r.messages) == r.prompt
            if prev is not None:
                assert ids[: len(prev)] == prev  # the whole previous turn is a token prefix
                # history + a scripted reply of the previous turn's output length + a user turn
                added = len(ids) - len(prev)
                assert s.requests[turn - 1].output_len + 8 - 2 <= added <= 7 + 12 + 2
            prev = ids


def test_multi_class_draws_classes_by_share_with_their_lengths(tok):
    classes = [
        RequestClass.parse("name=chat,share=3,input=10-20,output=4,priority=0,ttft=200,tpot=50"),
        RequestClass.parse("name=batch,share=1,input=40-50,output=8-12,priority=5,e2el=5000"),
    ]
    assert classes[0].slo == {"ttft": 200.0, "tpot": 50.0} and classes[1].priority == 5
    sessions = wl.multi_class_workload(tok, 80, classes, seed=2)
    assert sessions == wl.multi_class_workload(tok, 80, classes, seed=2)
    by = {c.name: c for c in classes}
    counts = {"chat": 0, "batch": 0}
    for s in sessions:
        (r,) = s.requests
        c = by[r.cls]
        counts[r.cls] += 1
        assert r.prompt_len in c.input_len and r.output_len in c.output_len
        assert r.priority == c.priority
    assert 45 <= counts["chat"] <= 75  # about 3 in 4


def test_class_spec_errors_are_plain():
    with pytest.raises(ValueError, match="name="):
        RequestClass.parse("share=1")
    with pytest.raises(ValueError, match="knows no"):
        RequestClass.parse("name=a,colour=red")


def test_jsonl_prompts(tok, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "The quick brown fox"}\n\n{"prompt": "Paged attention", "output_len": 9}\n'
    )
    sessions = wl.prompts_workload(tok, str(path), 10, output_len=33, seed=0)
    got = sorted((s.requests[0].prompt, s.requests[0].output_len) for s in sessions)
    assert got == [("Paged attention", 9), ("The quick brown fox", 33)]
