"""tools/bench_tree.py: its ratios are paired per prompt and round, its table keeps a fixed order,
and a tiny run on the demo bundle writes the JSON, the table and the PNG."""

from __future__ import annotations

import json

import pytest

from tools.bench_tree import configs, markdown, summarize


def samples(config: str, rates: list[float]) -> list[dict]:
    return [{"bundle": "b", "workload": "templated", "threads": 1, "kernels": "avx2", "prompt": f"p{i}", "round": 0,
             "config": config, "tokens_per_second": rate, "tokens_per_pass": 2.0, "seconds_per_pass": 0.05,
             "identical": True} for i, rate in enumerate(rates)]


def test_ratios_are_medians_of_each_prompts_pair_and_the_table_keeps_the_configurations_order():
    rows = summarize(samples("llama.cpp", [10, 20, 40]) + samples("ngram tree", [30, 30, 40])
                     + samples("full", [20, 40, 40]))
    assert [r["config"] for r in rows] == ["full", "ngram tree", "llama.cpp"]
    tree = rows[1]
    assert tree["vs_llama"] == 1.5 and tree["vs_full"] == 1.0  # medians of 3, 1.5, 1 and 1.5, 0.75, 1
    assert tree["tokens_per_second"] == 30 and tree["identical"] == tree["samples"] == 3
    assert "| b | templated | 1 | avx2 | ngram tree | 30.0 | 1.00 | 1.50 | 2.00 | 50 | 3/3 |" in markdown(rows)
    assert list(configs(3, None)) == ["full", "ngram linear", "ngram tree", "slm linear", "slm tree",
                                      "ngram+slm linear", "ngram+slm tree", "ngram memory", "ngram+slm memory"]


@pytest.mark.slow
def test_a_tiny_run_on_the_demo_bundle_writes_its_record(smollm2_bundles, tmp_path):
    pytest.importorskip("llama_cpp")
    from tools.bench_tree import main

    bundle = smollm2_bundles["int4"][0]
    assert main(["--bundles", str(bundle), "--workloads", "templated", "--prompts", "1", "--rounds", "1",
                 "--max-new-tokens", "6", "--threads", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "tree.json").read_text())
    assert {"machine", "commit", "command", "samples", "summary"} <= set(record)
    assert {s["config"] for s in record["samples"]} == {*configs(3, None), "llama.cpp"}  # the demo's SLM: no GGUF
    assert all(s["identical"] for s in record["samples"] if s["config"] != "llama.cpp")
    assert (tmp_path / "tree.png").stat().st_size and "ngram+slm tree" in (tmp_path / "tree.md").read_text()
