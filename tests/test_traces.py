"""Reading token traces: `edgeroute trace FILE` and edgeroute.measure.traces (what each token
cost, per source; the cost heatmap)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from edgeroute.cli import app
from edgeroute.errors import InputError
from edgeroute.measure.traces import coloured_text, plot_trace, read_trace, split_turns, summarize
from edgeroute.runtime.decoding import TokenTrace

runner = CliRunner()


def write_trace(path, traces) -> None:
    path.write_text("".join(json.dumps(dataclasses.asdict(t)) + "\n" for t in traces))


def speculated_answer() -> list[TokenTrace]:
    """An answer of four tokens from two verification passes: the first pass's time on its first
    token (a draft the LLM accepted), the LLM's own token after it."""
    return [TokenTrace(10, 5, "draft:slm", 0.030, text="Na"),
            TokenTrace(11, 6, "llm", 0.0, layers="rrrr", layers_run=4, layers_skipped=0, text="vigating"),
            TokenTrace(12, 7, "draft:ngram", 0.020, text=" to"),
            TokenTrace(13, 8, "llm", 0.010, layers="rmsr", layers_run=2, layers_skipped=2, text=" Paris")]


def test_summary_counts_tokens_time_and_llm_layer_work_per_source():
    summary = summarize(speculated_answer())
    assert (summary.turns, summary.tokens, summary.llm_passes) == (1, 4, 2)
    assert summary.tokens_per_llm_pass == 2.0
    assert summary.seconds == pytest.approx(0.060)
    assert summary.layers == {"run": 6, "attention only": 1, "skipped": 1, "dropped": 0}
    rows = {row.source: row for row in summary.sources}
    assert [row.source for row in summary.sources] == ["llm", "draft:slm", "draft:ngram"]
    assert (rows["llm"].tokens, rows["llm"].share) == (2, 0.5)
    assert rows["draft:slm"].time_share == pytest.approx(0.5)
    assert rows["llm"].ms_per_token == pytest.approx(5.0)
    assert summary.to_dict()["tokens_per_llm_pass"] == 2.0


def test_a_chat_trace_splits_into_its_answers_where_positions_jump():
    first = speculated_answer()
    second = [dataclasses.replace(t, position=t.position + 20) for t in speculated_answer()[:3]]
    turns = split_turns(first + second)
    assert [len(turn) for turn in turns] == [4, 3]
    assert summarize(first + second).turns == 2
    assert "next turn" in coloured_text(first + second).plain


def test_coloured_text_is_the_answer_and_shows_ids_where_no_token_has_text():
    assert coloured_text(speculated_answer()).plain == "Navigating to Paris"
    bare = [dataclasses.replace(t, text="") for t in speculated_answer()]
    assert coloured_text(bare).plain == "[5][6][7][8]"


def test_a_trace_the_run_wrote_reads_back_as_its_answer(tiny_slm_bundle, tmp_path):
    trace = tmp_path / "runs" / "trace.jsonl"
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "one two three one two", "--raw",
                                 "--mode", "speculate", "--max-new-tokens", "12", "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    tokens = read_trace(trace)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [t.token for t in tokens] == [r["token"] for r in records]
    summary = summarize(tokens)
    assert summary.tokens == 12
    assert summary.llm_passes == sum(r["source"] == "llm" for r in records)
    assert coloured_text(tokens).plain == "".join(r["text"] for r in records)

    summaries = []  # the table, the JSON and the heatmap are of one summary, made once

    def counted(traces):
        summaries.append(summarize(traces))
        return summaries[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("edgeroute.measure.traces.summarize", counted)
        shown = runner.invoke(app, ["trace", str(trace), "--json", str(tmp_path / "summary.json"),
                                    "--png", str(tmp_path / "map.png")])
    assert shown.exit_code == 0, shown.output
    assert len(summaries) == 1
    assert "12 tokens" in shown.output and "tokens per pass" in shown.output
    assert json.loads((tmp_path / "summary.json").read_text())["tokens"] == 12
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_trace_command_shows_one_answer_of_a_chat(tmp_path):
    trace = tmp_path / "chat.jsonl"
    write_trace(trace, speculated_answer() + [dataclasses.replace(t, position=t.position + 20)
                                              for t in speculated_answer()[:3]])
    second = runner.invoke(app, ["trace", str(trace), "--turn", "2"])
    assert second.exit_code == 0, second.output
    assert "1 answer(s), 3 tokens" in second.output
    beyond = runner.invoke(app, ["trace", str(trace), "--turn", "3"])
    assert beyond.exit_code == 2 and "holds 2 answer(s)" in beyond.output


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: a token is a JSON object"),
    ('{"token": 3, "source": "llm", "seconds": 0.1}', "line 2: no position"),
    ('{"position": "3", "token": 3, "source": "llm", "seconds": 0.1}', "line 2: position must be a whole number"),
    ('{"position": 3, "token": 3, "source": "llm", "seconds": NaN}', "line 2: seconds must be a finite"),
    ('{"position": 3, "token": 3, "source": "llm", "seconds": -0.5}', "line 2: seconds must be a finite"),
    ('{"position": 3, "token": 3, "source": "llm", "seconds": 0.1, "layers": "rrx"}', "line 2: layers holds 'x'"),
    ('{"position": 3, "token": 3, "source": "llm", "seconds": 0.1, "text": 5}', "line 2: text must be a string, got 5"),
    ('{"position": 3, "token": 3, "source": "llm", "seconds": 0.1, "fallback": "no"}',
     "line 2: fallback must be true or false, got 'no'"),
    ('{"position": 3, "token": 3, "source": "llm", "seconds": 0.1, "router_score": "high"}',
     "line 2: router_score must be a number or null, got 'high'"),
])
def test_a_damaged_trace_line_is_an_error_naming_the_line(tmp_path, line, message):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(dataclasses.asdict(speculated_answer()[0])) + "\n" + line + "\n")
    with pytest.raises(InputError, match=message):
        read_trace(trace)


def test_missing_empty_and_binary_trace_files_are_clear_errors(tmp_path):
    with pytest.raises(InputError, match="cannot read the trace file"):
        read_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match="holds no tokens"):
        read_trace(tmp_path / "empty.jsonl")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InputError, match="is not text"):
        read_trace(tmp_path / "binary.jsonl")
    result = runner.invoke(app, ["trace", str(tmp_path / "absent.jsonl")])
    assert result.exit_code == 2 and "error:" in result.output


def test_fields_a_later_version_adds_are_ignored(tmp_path):
    trace = tmp_path / "trace.jsonl"
    record = {**dataclasses.asdict(speculated_answer()[1]), "energy_joules": 0.2}
    trace.write_text(json.dumps(record) + "\n")
    assert read_trace(trace) == [speculated_answer()[1]]


def test_the_heatmap_is_a_png_and_its_path_is_checked_before_drawing(tmp_path):
    assert plot_trace(speculated_answer(), tmp_path / "plots" / "map.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(InputError, match="is a folder"):
        plot_trace(speculated_answer(), tmp_path)
    with pytest.raises(InputError, match="ending in .png"):
        plot_trace(speculated_answer(), tmp_path / "map.jpg")
    with pytest.raises(InputError, match="at least one token"):
        plot_trace([], tmp_path / "none.png")
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, speculated_answer())
    refused = runner.invoke(app, ["trace", str(trace), "--png", str(tmp_path)])
    assert refused.exit_code == 2 and "is a folder" in refused.output


def test_print_trace_writes_the_table_and_layer_work(tmp_path):
    from edgeroute.measure.traces import print_trace

    console = Console(record=True, width=100)
    print_trace(speculated_answer(), console)
    out = console.export_text()
    assert "2 LLM passes (2.00 tokens per pass)" in out
    assert "6 run (75%), 1 attention only (12%), 1 skipped (12%)" in out
    assert "Navigating to Paris" in out


def test_eval_and_bench_refuse_a_folder_for_their_outputs_before_running(tmp_path):
    missing_bundle = str(tmp_path / "no-bundle")
    plot = runner.invoke(app, ["eval", missing_bundle, "--tasks", "builtin", "--plot", str(tmp_path)])
    assert plot.exit_code == 2 and "is a folder" in plot.output
    report = runner.invoke(app, ["eval", missing_bundle, "--tasks", "builtin", "--json", str(tmp_path)])
    assert report.exit_code == 2 and "is a folder" in report.output
    bench = runner.invoke(app, ["bench", missing_bundle, "--json", str(tmp_path)])
    assert bench.exit_code == 2 and "is a folder" in bench.output
