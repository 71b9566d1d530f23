"""Simulated workloads: drawn prompts are the same ids every read and cost no memory until
read; a bench workload becomes the very requests `tandem bench serve` would send."""

from __future__ import annotations

from tandem.bench.arrivals import arrival_times
from tandem.bench.workloads import LengthRange, random_workload
from tandem.sim.workload import RandomTokens, azure_trace, from_bench, random_requests


def test_drawn_prompts_are_the_same_ids_every_read_and_differ_between_requests():
    a, b = RandomTokens((0, 1), 50), RandomTokens((0, 2), 50)
    assert len(a) == 50 and list(a) == list(a) == list(RandomTokens((0, 1), 50))
    assert a == tuple(a) and a != b and a[3] == list(a)[3]
    requests = random_requests(20, 64, 8, 5.0, seed=7, range_ratio=0.5)
    assert requests == random_requests(20, 64, 8, 5.0, seed=7, range_ratio=0.5)
    assert all(32 <= len(r.prompt) <= 96 for r in requests)
    assert len({tuple(r.prompt[:16]) for r in requests}) == 20  # no accidental shared prefix


def test_a_bench_workload_becomes_the_requests_the_bench_would_send(llama_path):
    from tandem.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(llama_path)
    sessions = random_workload(tok, 12, LengthRange(20, 40), LengthRange(5, 9), seed=3)
    encode = lambda text: tok.encode(text, add_special_tokens=True)  # noqa: E731
    requests = from_bench(sessions, encode, 4.0, 1.0, seed=3)
    assert [r.arrival for r in requests] == arrival_times(12, 4.0, 1.0, 3)
    for r, s in zip(requests, sessions):
        assert list(r.prompt) == encode(s.requests[0].prompt)
        assert r.output_len == s.requests[0].output_len


def test_an_azure_trace_replays_its_timestamps_and_lengths(tmp_path):
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.9951690,396,109\n"
                     "2023-11-16 18:15:51.2481130,0,7\n")  # fmt: skip
    requests = azure_trace(trace)
    assert [round(r.arrival, 3) for r in requests] == [0.0, 4.315, 4.568]
    assert [len(r.prompt) for r in requests] == [374, 396, 1]  # an empty context still runs
    assert [r.output_len for r in requests] == [44, 109, 7]
    assert len(azure_trace(trace, limit=2)) == 2


def test_a_shifting_mix_moves_from_prompt_heavy_to_decode_heavy_and_back():
    from tandem.sim.workload import shifting_mix_requests

    requests = shifting_mix_requests(3000, 2.0, (4000, 10), (100, 500), seed=3)
    assert requests == shifting_mix_requests(3000, 2.0, (4000, 10), (100, 500), seed=3)
    assert 5400 < len(requests) < 6600  # Poisson at 2 req/s

    def heavy_share(lo: float, hi: float) -> float:
        part = [r for r in requests if lo <= r.arrival < hi]
        return sum(len(r.prompt) == 4000 for r in part) / len(part)

    # 90% prompt-heavy at the ends, 10% halfway (a cosine between)
    assert heavy_share(0, 150) > 0.8 and heavy_share(2850, 3000) > 0.8
    assert heavy_share(1350, 1650) < 0.2
    assert {r.output_len for r in requests} == {10, 500}
