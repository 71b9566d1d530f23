"""`tandem bench serve` and `tandem bench compare` end to end, against scripted servers."""

from __future__ import annotations

import json

import pytest

from tandem.bench.compare import compare_rows, format_table
from tandem.cli import main
from tests.bench.scripted_server import ScriptedServer

VLLM_KEYS = [
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "duration",
    "mean_ttft_ms",
    "median_ttft_ms",
    "std_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "model_id",
    "tokenizer_id",
]


def workload_args(llama_path, tmp_path, n=6):
    return [
        "--tokenizer",
        str(llama_path),
        "--num-prompts",
        str(n),
        "--random-input-len",
        "16",
        "--random-output-len",
        "4",
        "--result-dir",
        str(tmp_path),
        "--disable-tqdm",
    ]


def test_serve_sweep_writes_vllm_json_and_plots(llama_path, tmp_path, capsys):
    with ScriptedServer({"ttft": 0.03, "itl": 0.01}) as server:
        rc = main(
            [
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--request-rate",
                "20,40",
                "--goodput",  # loose: the scripted 30 ms TTFT meets it on a loaded machine
                "ttft:10000",
                "tpot:2000",
                "--save-result",
                "--save-detailed",
                "--plot",
                "--result-filename",
                "run",
                *workload_args(llama_path, tmp_path),
            ]
        )
        sent = server.requests
    assert rc == 0
    shown = capsys.readouterr().out
    assert "Serving Benchmark Result" in shown and "Request goodput (req/s):" in shown
    assert len(sent) == 1 + 2 * 6  # the ready check, then the workload at each rate
    assert sent[1]["model"] == "scripted" and sent[1]["max_tokens"] == 4 and sent[1]["stream"]
    assert sent[1]["stream_options"] == {"include_usage": True}
    # Each point sends its own prompts, so no server's prefix cache can serve the second
    # point from the first, nor the ready check's prompt any point.
    first, second = {r["prompt"] for r in sent[1:7]}, {r["prompt"] for r in sent[7:]}
    assert len(first) == len(second) == 6 and not first & second
    assert sent[0]["prompt"] not in first | second
    for rate, seed in (("20.0", 0), ("40.0", 1)):
        doc = json.loads((tmp_path / f"run-rate{rate}.json").read_text())
        assert all(k in doc for k in VLLM_KEYS), [k for k in VLLM_KEYS if k not in doc]
        assert doc["completed"] == 6 and doc["failed"] == 0
        assert doc["total_output_tokens"] == 24
        assert doc["slo_attainment"]["all"]["attainment"] == 1.0
        assert doc["request_goodput"] == pytest.approx(6 / doc["duration"])
        assert len(doc["ttfts"]) == len(doc["itls"]) == 6
        assert doc["seed"] == seed
    sweep = json.loads((tmp_path / "run-sweep.json").read_text())
    assert [p["request_rate"] for p in sweep["points"]] == [20.0, 40.0]
    assert (tmp_path / "run-cdf.png").stat().st_size > 10_000
    assert (tmp_path / "run-sweep.png").stat().st_size > 10_000


def test_serve_chat_multi_turn(llama_path, tmp_path):
    with ScriptedServer({"ttft": 0.01, "itl": 0.0}) as server:
        rc = main(
            [
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--backend",
                "openai-chat",
                "--dataset-name",
                "multi-turn",
                "--turns",
                "3",
                "--max-concurrency",
                "2",
                "--save-result",
                "--result-filename",
                "chat.json",
                *workload_args(llama_path, tmp_path),
            ]
        )
        sent = server.requests[1:]
    assert rc == 0
    doc = json.loads((tmp_path / "chat.json").read_text())
    assert doc["completed"] == 6 and doc["max_concurrent_requests"] <= 2
    assert sorted(len(p["messages"]) for p in sent) == [1, 1, 3, 3, 5, 5]


def test_find_max_rate_doubles_while_slos_hold(llama_path, tmp_path, capsys):
    with ScriptedServer({"ttft": 0.01, "itl": 0.0}) as server:
        rc = main(["bench", "serve", "--base-url", server.url, "--find-max-rate",
                   "--goodput", "e2el:5000", "--request-rate", "50", "--max-probes", "2",
                   "--save-result", "--result-filename", "search",
                   *workload_args(llama_path, tmp_path, n=4)])  # fmt: skip
    assert rc == 0
    assert "max rate with SLO attainment >= 90%: 100 req/s" in capsys.readouterr().out
    doc = json.loads((tmp_path / "search-sweep.json").read_text())
    probes = [p for p in doc["points"] if p.get("search_probe")]
    assert [p["request_rate"] for p in probes] == [50.0, 100.0]
    assert all(p["max_rate_found"] == 100.0 for p in probes)


def test_find_max_rate_needs_slos(llama_path, tmp_path, capsys):
    with ScriptedServer() as server:
        rc = main(
            [
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--find-max-rate",
                *workload_args(llama_path, tmp_path),
            ]
        )
    assert rc == 2 and "needs SLOs" in capsys.readouterr().err


def test_compare_runs_both_servers_and_prints_ratios(llama_path, tmp_path, capsys):
    fast = ScriptedServer({"ttft": 0.01, "itl": 0.0})
    slow = ScriptedServer({"ttft": 0.2, "itl": 0.05})
    with fast, slow:
        rc = main(
            [
                "bench",
                "compare",
                "--peer",
                "vllm",
                "--tandem-url",
                fast.url,
                "--peer-url",
                slow.url,
                "--max-concurrency",
                "1,4",
                "--result-filename",
                "cmp.json",
                *workload_args(llama_path, tmp_path, n=4),
            ]
        )
    assert rc == 0
    out = capsys.readouterr().out
    assert "random rate=inf c=1" in out and "random rate=inf c=4" in out
    doc = json.loads((tmp_path / "cmp.json").read_text())
    assert len(doc["rows"]) == 2 and len(doc["tandem"]) == len(doc["vllm"]) == 2
    for row in doc["rows"]:
        assert row["completed"] == [4, 4]
        assert row["mean_ttft_ms"]["ratio"] < 0.6  # 10 ms against 200 ms
        assert row["output_throughput"]["ratio"] > 1.5


def test_compare_table_reads_side_by_side():
    a = {
        "dataset_name": "random",
        "request_rate": "inf",
        "max_concurrency": 16,
        "completed": 9,
        "output_throughput": 200.0,
        "mean_ttft_ms": 50.0,
        "p99_ttft_ms": 90.0,
        "mean_tpot_ms": 20.0,
        "p99_tpot_ms": 30.0,
    }
    b = dict(a, output_throughput=100.0, mean_ttft_ms=100.0)
    rows = compare_rows([a], [b])
    assert rows[0]["output_throughput"] == {"tandem": 200.0, "peer": 100.0, "ratio": 2.0}
    table = format_table(rows, "vllm")
    assert "random rate=inf c=16" in table
    assert "out tok/s           200.0      100.0   2.00x +" in table
    assert "TTFT mean ms         50.0      100.0   0.50x +" in table
    assert "TPOT mean ms         20.0       20.0   1.00x" in table


def test_compare_table_adds_goodput_and_attainment_rows_only_when_slos_were_given():
    base = {
        "dataset_name": "random",
        "request_rate": 1.0,
        "max_concurrency": None,
        "completed": 10,
        "output_throughput": 100.0,
        "mean_ttft_ms": 50.0,
        "p99_ttft_ms": 90.0,
        "mean_tpot_ms": 20.0,
        "p99_tpot_ms": 30.0,
    }
    assert "goodput" not in format_table(compare_rows([base], [base]), "vllm")

    def with_slos(goodput: float, good: int) -> dict:
        attain = {"all": {"requests": 10, "good": good, "attainment": good / 10}}
        return dict(base, request_goodput=goodput, slo_attainment=attain)

    rows = compare_rows([with_slos(0.9, 9)], [with_slos(0.3, 3)])
    assert rows[0]["slo_attainment_pct"] == {"tandem": 90.0, "peer": 30.0, "ratio": 3.0}
    table = format_table(rows, "vllm")
    assert "goodput req/s         0.9        0.3   3.00x +" in table
    assert "SLO attain %         90.0       30.0   3.00x +" in table
