"""Benchmark workloads, generated from a seed so a run repeats exactly.

A workload is a list of `Session`s. A session is what one client does: a single request
for most workloads, or the turns of one conversation, sent one after another, each turn
resending the whole history. Lengths are counted with the model's own tokenizer.

Prompts made of random tokens follow `vllm bench serve --dataset-name random`: draw token
ids, decode, re-encode, and adjust until the text encodes to the wanted length. Where
prompts must share a prefix (shared-prefix groups, conversation histories), the new text
is redrawn until the prefix's tokens survive the join unchanged, so a server's prefix
cache sees the same tokens a client meant to share.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

MAX_TRIES = 20

# Short chat prompts whose greedy replies the quantization tests and
# benchmarks/greedy_agreement.py compare between numeric paths.
CHAT_PROMPTS = (
    "What is the capital of France? Tell me about it.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about the sea.",
    "List three uses of copper.",
    "How do I boil an egg?",
    "What is 17 times 23?",
    "Who wrote Hamlet?",
    "Give me a tip for learning Python.",
)


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # the text sent to /v1/completions
    prompt_len: int  # tokens of `prompt`
    output_len: int  # max_tokens asked for
    messages: tuple[dict, ...] | None = None  # sent to /v1/chat/completions (else one user turn)
    cls: str = "default"  # SLO class
    priority: int | None = None  # sent as the request's `priority` when set
    body: dict | None = None  # more fields of the request body (a response_format)


@dataclass(frozen=True)
class Session:
    requests: tuple[BenchRequest, ...]


@dataclass(frozen=True)
class LengthRange:
    """Token lengths in [low, high], drawn uniformly."""

    low: int
    high: int

    @classmethod
    def around(cls, length: int, ratio: float = 0.0) -> LengthRange:
        """vLLM's --random-range-ratio: [length * (1 - ratio), length * (1 + ratio)]."""
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"range ratio: {ratio} is not in [0, 1)")
        return cls(max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio))))

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """'128' or '64-256'."""
        low, _, high = text.partition("-")
        return cls(int(low), int(high or low))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __contains__(self, n: int) -> bool:
        return self.low <= n <= self.high


@dataclass(frozen=True)
class RequestClass:
    """A traffic class: its share of requests, its lengths, its priority and its SLOs (ms)."""

    name: str
    share: float = 1.0
    input_len: LengthRange = LengthRange(256, 256)
    output_len: LengthRange = LengthRange(128, 128)
    priority: int | None = None
    slo: dict[str, float] = field(default_factory=dict)  # "ttft" | "tpot" | "e2el" -> ms

    @classmethod
    def parse(cls, spec: str) -> RequestClass:
        """'name=chat,share=0.7,input=64-256,output=128,priority=0,ttft=500,tpot=50'."""
        kv = dict(item.split("=", 1) for item in spec.split(",") if item)
        unknown = set(kv) - {"name", "share", "input", "output", "priority", "ttft", "tpot", "e2el"}
        if unknown or "name" not in kv:
            raise ValueError(f"class: {spec!r} needs name=... and knows no {sorted(unknown)}")
        return cls(
            name=kv["name"],
            share=float(kv.get("share", 1.0)),
            input_len=LengthRange.parse(kv.get("input", "256")),
            output_len=LengthRange.parse(kv.get("output", "128")),
            priority=int(kv["priority"]) if "priority" in kv else None,
            slo={k: float(kv[k]) for k in ("ttft", "tpot", "e2el") if k in kv},
        )


class TokenText:
    """Random text of a given token length, and text appended without disturbing a prefix."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.vocab = [i for i in range(len(tokenizer)) if i not in special | added]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def random(self, rng: random.Random, length: int) -> tuple[str, list[int]]:
        """Text that encodes to exactly `length` tokens (as vLLM's decode/re-encode loop)."""
        for _ in range(MAX_TRIES):
            ids = [rng.choice(self.vocab) for _ in range(length)]
            for _ in range(10):
                text = self.tokenizer.decode(ids)
                ids = self.encode(text)
                if len(ids) == length:
                    return text, ids
                if len(ids) > length:
                    ids = ids[:length]
                else:
                    ids += [rng.choice(self.vocab) for _ in range(length - len(ids))]
        raise ValueError(f"tokenizer: no random text encodes to {length} tokens")

    def extend(
        self, rng: random.Random, base: str, base_ids: list[int], length: int
    ) -> tuple[str, list[int]]:
        """base + about `length` tokens of new text; base's tokens stay a prefix, token for
        token (the join is redrawn until they do)."""
        for _ in range(MAX_TRIES):
            tail, _ = self.random(rng, length)
            ids = self.encode(base + tail)
            if ids[: len(base_ids)] == base_ids:
                return base + tail, ids
        raise ValueError("tokenizer: cannot extend a prompt without changing its prefix tokens")


def random_workload(
    tokenizer,
    num: int,
    input_len: LengthRange,
    output_len: LengthRange,
    seed: int = 0,
    cls: RequestClass | None = None,
) -> list[Session]:
    rng = random.Random(seed)
    text = TokenText(tokenizer)
    return [Session((_random_request(text, rng, input_len, output_len, cls),)) for _ in range(num)]


def _random_request(
    text: TokenText,
    rng: random.Random,
    input_len: LengthRange,
    output_len: LengthRange,
    cls: RequestClass | None = None,
) -> BenchRequest:
    prompt, ids = text.random(rng, input_len.draw(rng))
    return BenchRequest(
        prompt=prompt,
        prompt_len=len(ids),
        output_len=output_len.draw(rng),
        cls=cls.name if cls else "default",
        priority=cls.priority if cls else None,
    )


def tool_schemas() -> list[dict]:
    """100 function-calling tools shaped like real agent tools (nested objects, enums,
    arrays, optional fields; scripts/make_tool_schemas.py writes them)."""
    import json
    from importlib.resources import files

    return json.loads(files("tandem.bench").joinpath("data/tool_schemas.json").read_text())


def json_schema_workload(
    tokenizer, num: int, input_len: LengthRange, output_len: LengthRange, seed: int = 0
) -> list[Session]:
    """Requests whose answer must match a tool's parameter schema (response_format
    json_schema), the tools taken in turn: an agent's structured calls."""
    rng = random.Random(seed)
    text = TokenText(tokenizer)
    tools = tool_schemas()
    sessions = []
    for i in range(num):
        f = tools[i % len(tools)]["function"]
        ask = f"Answer with the arguments of {f['name']} ({f['description']}) as JSON for: "
        prompt, ids = text.random(rng, input_len.draw(rng))
        fmt = {"type": "json_schema", "json_schema": {"name": f["name"], "schema": f["parameters"]}}
        sessions.append(Session((BenchRequest(
            prompt=ask + prompt, prompt_len=len(tokenizer.encode(ask + prompt)),
            output_len=output_len.draw(rng), body={"response_format": fmt},
        ),)))  # fmt: skip
    return sessions


def shared_prefix_workload(
    tokenizer,
    num: int,
    groups: int,
    prefix_len: int,
    suffix_len: LengthRange,
    output_len: LengthRange,
    seed: int = 0,
) -> list[Session]:
    """`groups` long prefixes (a system prompt, a document); each prompt is one of them plus
    its own suffix. Requests of all groups are shuffled together."""
    if groups < 1:
        raise ValueError(f"prefix groups: {groups} is below 1")
    rng = random.Random(seed)
    text = TokenText(tokenizer)
    prefixes = [text.random(rng, prefix_len) for _ in range(groups)]
    sessions = []
    for i in range(num):
        prefix, prefix_ids = prefixes[i % groups]
        prompt, ids = text.extend(rng, prefix, prefix_ids, suffix_len.draw(rng))
        req = BenchRequest(prompt, len(ids), output_len.draw(rng), cls=f"group{i % groups}")
        sessions.append(Session((req,)))
    rng.shuffle(sessions)
    return sessions


def multi_turn_workload(
    tokenizer,
    num_conversations: int,
    turns: int,
    user_len: LengthRange,
    output_len: LengthRange,
    seed: int = 0,
) -> list[Session]:
    """Conversations whose every turn resends the growing history, as chat and agent
    clients do. The assistant turns in the history are scripted text of the length that
    turn asked for, so the workload does not depend on what a server answered."""
    rng = random.Random(seed)
    text = TokenText(tokenizer)
    sessions = []
    for _ in range(num_conversations):
        history, ids, messages, requests = "", [], [], []
        for turn in range(turns):
            history, ids = text.extend(rng, history, ids, user_len.draw(rng))
            messages.append({"role": "user", "content": history[len(_joined(messages)) :]})
            out = output_len.draw(rng)
            requests.append(BenchRequest(history, len(ids), out, messages=tuple(messages)))
            if turn + 1 < turns:
                history, ids = text.extend(rng, history, ids, out)
                messages.append({"role": "assistant", "content": history[len(_joined(messages)) :]})
        sessions.append(Session(tuple(requests)))
    return sessions


def _joined(messages: list[dict]) -> str:
    return "".join(m["content"] for m in messages)


def multi_class_workload(
    tokenizer, num: int, classes: list[RequestClass], seed: int = 0
) -> list[Session]:
    """Each request's class drawn by share; its lengths and priority from its class."""
    if not classes:
        raise ValueError("classes: give at least one --class")
    rng = random.Random(seed)
    text = TokenText(tokenizer)
    weights = [c.share for c in classes]
    sessions = []
    for _ in range(num):
        cls = rng.choices(classes, weights)[0]
        sessions.append(Session((_random_request(text, rng, cls.input_len, cls.output_len, cls),)))
    return sessions


def prompts_workload(
    tokenizer, path: str, num: int, output_len: int, seed: int = 0
) -> list[Session]:
    """A JSONL file of {"prompt": ..., optional "output_len"} (vLLM's custom dataset),
    shuffled with the seed and cut to `num`."""
    import json

    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if "prompt" not in row:
                    raise ValueError(f"dataset: {path}:{n} has no 'prompt'")
                rows.append(row)
    random.Random(seed).shuffle(rows)
    sessions = []
    for row in rows[:num]:
        prompt = row["prompt"]
        out = int(row.get("output_len") or output_len)
        prompt_len = len(tokenizer(prompt).input_ids)
        sessions.append(Session((BenchRequest(prompt, prompt_len, out),)))
    return sessions


def num_requests(sessions: list[Session]) -> int:
    return sum(len(s.requests) for s in sessions)
