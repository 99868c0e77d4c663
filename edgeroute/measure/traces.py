"""Reading token traces (``edgeroute run --trace FILE``, ``Generation.trace``): where each
token of a response came from and what it cost. The response coloured by the path that wrote
each token, a table per source (tokens, wall time, tokens per LLM pass, the LLM's layer work),
and a heatmap of what each LLM layer did per token over the time each token took.

A token's ``seconds`` is the wall time from the token before it (the prompt's prefill for the
first): a pass that yields several tokens (a verified draft) shows its whole cost on the first
of them and almost none on the rest, which is what the user waited for.

Device-side: stdlib, numpy and rich; matplotlib only for the PNG.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from edgeroute.errors import InputError
from edgeroute.plots import png_path, pyplot
from edgeroute.runtime.decoding import TokenTrace

REQUIRED = ("position", "token", "source", "seconds")
KNOWN = {field.name for field in dataclasses.fields(TokenTrace)}
# the optional fields as `run --trace` writes them: their types, as an error names them
OPTIONAL_FIELDS = {"router_score": ((int, float, type(None)), "a number or null"),
                   "layers_run": ((int, type(None)), "a whole number or null"),
                   "layers_skipped": ((int, type(None)), "a whole number or null"),
                   "importance": (list, "a list"), "fallback": (bool, "true or false"), "text": (str, "a string")}
# what each LLM layer did in a token's pass (TokenTrace.layers), in the heatmap's order
LAYER_ACTIONS = {"r": "run", "m": "attention only", "s": "skipped", "d": "dropped"}
# the sources in the order the tables list them; others (a mixed light path's drafters) follow
SOURCE_ORDER = ("llm", "draft:slm", "draft:ngram", "slm", "ngram", "grammar")
SOURCE_STYLES = {"llm": "bold red", "draft:slm": "green", "draft:ngram": "cyan", "slm": "yellow",
                 "ngram": "blue", "grammar": "dim"}
SOURCE_COLOURS = {"llm": "tab:red", "draft:slm": "tab:green", "draft:ngram": "tab:cyan", "slm": "tab:olive",
                  "ngram": "tab:blue", "grammar": "lightgrey"}
OTHER_STYLE, OTHER_COLOUR = "magenta", "tab:purple"
MAX_LABELLED_TOKENS = 64  # the heatmap names each token under its column up to this many


def read_trace(path: str | Path) -> list[TokenTrace]:
    """The tokens of a trace file, one JSON object per line as ``run --trace`` writes them
    (fields a later version adds are ignored). A line that is no such object, or a time that is
    negative or not finite, is an error naming the line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise InputError(f"cannot read the trace file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"the trace file {path} is not text (a JSONL file from `edgeroute run --trace`)") from None
    traces = [_token(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not traces:
        raise InputError(f"the trace file {path} holds no tokens")
    return traces


def _token(path: Path, number: int, line: str) -> TokenTrace:
    where = f"{path}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: a token is a JSON object, got {type(record).__name__}")
    missing = [name for name in REQUIRED if name not in record]
    if missing:
        raise InputError(f"{where}: no {', '.join(missing)} (is this a trace from `edgeroute run --trace`?)")
    for name in ("position", "token"):
        if isinstance(record[name], bool) or not isinstance(record[name], int):
            raise InputError(f"{where}: {name} must be a whole number, got {record[name]!r}")
    seconds = record["seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds < 0:
        raise InputError(f"{where}: seconds must be a finite number of at least 0, got {seconds!r}")
    if not isinstance(record["source"], str) or not isinstance(record.get("layers", ""), str):
        raise InputError(f"{where}: source and layers are strings")
    for name, (types, described) in OPTIONAL_FIELDS.items():
        if name in record and not isinstance(record[name], types):
            raise InputError(f"{where}: {name} must be {described}, got {record[name]!r}")
    unknown_actions = set(record.get("layers", "")) - set(LAYER_ACTIONS)
    if unknown_actions:
        raise InputError(f"{where}: layers holds {''.join(sorted(unknown_actions))!r}; "
                         f"each layer is one of {', '.join(LAYER_ACTIONS)}")
    try:
        return TokenTrace(**{name: value for name, value in record.items() if name in KNOWN})
    except TypeError as err:
        raise InputError(f"{where}: {err}") from None


def split_turns(traces: Sequence[TokenTrace]) -> list[list[TokenTrace]]:
    """The answers of a trace in order: a chat's next answer starts where a token's position
    does not follow the token before it (the user's turn came in between)."""
    turns: list[list[TokenTrace]] = []
    for trace in traces:
        if not turns or trace.position != turns[-1][-1].position + 1:
            turns.append([])
        turns[-1].append(trace)
    return turns


@dataclass(frozen=True)
class SourceCost:
    source: str
    tokens: int
    share: float  # of the tokens
    seconds: float
    time_share: float  # of the wall time

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.seconds / self.tokens


@dataclass(frozen=True)
class TraceSummary:
    turns: int
    tokens: int
    seconds: float  # wall time from each answer's request to its last token, prefill included
    llm_passes: int  # LLM forward passes: one chooses each token whose layers are traced
    layers: dict[str, int]  # LLM layer actions summed over the passes: run, attention only, ...
    fallback_tokens: int  # tokens written while the fallback monitor held routing and skipping off
    sources: list[SourceCost]

    @property
    def tokens_per_llm_pass(self) -> float | None:
        return self.tokens / self.llm_passes if self.llm_passes else None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tokens_per_llm_pass": self.tokens_per_llm_pass}


def summarize(traces: Sequence[TokenTrace]) -> TraceSummary:
    """What a trace (a file's tokens or ``Generation.trace``) spent, per source of its tokens."""
    if not traces:
        raise InputError("a trace summary needs at least one token")
    total = sum(trace.seconds for trace in traces)
    by_source: dict[str, list[TokenTrace]] = {}
    for trace in traces:
        by_source.setdefault(trace.source, []).append(trace)
    sources = []
    for source, group in sorted(by_source.items(), key=lambda item: _source_rank(item[0])):
        seconds = sum(trace.seconds for trace in group)
        sources.append(SourceCost(source, len(group), len(group) / len(traces), seconds,
                                  seconds / total if total > 0 else 0.0))
    letters = "".join(trace.layers for trace in traces)
    return TraceSummary(turns=len(split_turns(traces)), tokens=len(traces), seconds=total,
                        llm_passes=sum(bool(trace.layers) for trace in traces),
                        layers={name: letters.count(letter) for letter, name in LAYER_ACTIONS.items()},
                        fallback_tokens=sum(trace.fallback for trace in traces), sources=sources)


def _source_rank(source: str) -> tuple[int, str]:
    return (SOURCE_ORDER.index(source) if source in SOURCE_ORDER else len(SOURCE_ORDER), source)


def coloured_text(traces: Sequence[TokenTrace]) -> Text:
    """The response as the user read it, each token in its source's colour; a token with no text
    (``generate_tokens``' traces, a piece of a character) shows its id where the whole trace has none."""
    with_text = any(trace.text for trace in traces)
    text = Text()
    for number, turn in enumerate(split_turns(traces)):
        if number:
            text.append("\n--- next turn ---\n", style="dim italic")
        for trace in turn:
            text.append(trace.text if with_text else f"[{trace.token}]",
                        style=SOURCE_STYLES.get(trace.source, OTHER_STYLE))
    return text


def print_trace(traces: Sequence[TokenTrace], console: Console, show_text: bool = True) -> TraceSummary:
    """The coloured response, its legend and the per-source table; returns the summary."""
    summary = summarize(traces)
    per_pass = summary.tokens_per_llm_pass
    console.print(f"{summary.turns} answer(s), {summary.tokens} tokens in {summary.seconds:.3f} s, "
                  f"{summary.llm_passes} LLM passes"
                  + (f" ({per_pass:.2f} tokens per pass)" if per_pass is not None else ""))
    if show_text:
        console.print(coloured_text(traces))
        legend = Text("colours: ")
        for row in summary.sources:
            legend.append(row.source, style=SOURCE_STYLES.get(row.source, OTHER_STYLE)).append("  ")
        console.print(legend)
    table = Table(box=None, padding=(0, 1), header_style="bold")
    for heading in ("source", "tokens", "share", "waited s", "of time", "ms/token"):
        table.add_column(heading, justify="left" if heading == "source" else "right")
    for row in summary.sources:
        table.add_row(Text(row.source, style=SOURCE_STYLES.get(row.source, OTHER_STYLE)), str(row.tokens),
                      f"{row.share:.0%}", f"{row.seconds:.3f}", f"{row.time_share:.0%}", f"{row.ms_per_token:.1f}")
    console.print(table)
    if any(row.source.startswith("draft:") for row in summary.sources):
        console.print(Text("waited: the time before each token appeared; a verification pass's shows on the first "
                           "token it yields, often a draft", style="dim"))
    layer_total = sum(summary.layers.values())
    if layer_total:
        console.print("LLM layers over its passes: " + ", ".join(
            f"{count} {name} ({count / layer_total:.0%})" for name, count in summary.layers.items() if count))
    if summary.fallback_tokens:
        console.print(f"{summary.fallback_tokens} token(s) written while the fallback monitor held routing "
                      "and skipping off")
    return summary


def plot_trace(traces: Sequence[TokenTrace], path: str | Path, title: str | None = None,
               summary: TraceSummary | None = None) -> Path:
    """The cost heatmap of a trace: per token (columns, in order) the path that wrote it and the
    router's score where one scored it (top), what each LLM layer did in the pass that chose it
    (rows: run, attention only, skipped, dropped; blank where no LLM pass chose the token), and
    its wall time (bottom). A vertical line starts a chat's next answer. ``summary``: the
    traces' :func:`summarize`, where the caller has it already."""
    import numpy as np

    path = png_path(path)
    summary = summary if summary is not None else summarize(traces)
    plt = pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    n = len(traces)
    actions = list(LAYER_ACTIONS)
    grid = np.full((max([len(trace.layers) for trace in traces] + [1]), n), np.nan)
    for column, trace in enumerate(traces):
        for layer, letter in enumerate(trace.layers):
            grid[layer, column] = actions.index(letter)
    sources = [row.source for row in summary.sources]
    colours = [SOURCE_COLOURS.get(source, OTHER_COLOUR) for source in sources]

    fig, (top, middle, bottom) = plt.subplots(3, 1, sharex=True, figsize=(min(24.0, max(6.4, 0.16 * n + 2.5)), 6.0),
                                              gridspec_kw={"height_ratios": [0.6, 3.0, 1.4]})
    top.imshow([[sources.index(trace.source) for trace in traces]], aspect="auto", cmap=ListedColormap(colours),
               vmin=-0.5, vmax=len(sources) - 0.5, interpolation="nearest")
    top.set_yticks([])
    per_pass = summary.tokens_per_llm_pass
    counts = f"{n} tokens, {summary.llm_passes} LLM passes" + (
        f" ({per_pass:.2f} tokens per pass)" if per_pass is not None else "")
    top.set_title(f"{title}: {counts}" if title else counts, fontsize=9)
    scores = [np.nan if trace.router_score is None else trace.router_score for trace in traces]
    scored = not np.isnan(scores).all()
    if scored:
        router = top.twinx()
        router.plot(range(n), scores, color="black", linewidth=1, marker=".", markersize=3)
        router.set_ylim(0.0, max(1.0, float(np.nanmax(scores))))
        router.set_ylabel("router", fontsize=7)
        router.tick_params(labelsize=6)
    top.legend(handles=[Patch(color=c, label=s) for s, c in zip(sources, colours, strict=True)], loc="upper left",
               bbox_to_anchor=(1.08 if scored else 1.01, 1.0), fontsize=7, title="token from", title_fontsize=7)
    action_colours = ["#08306b", "#6baed6", "#fdae6b", "#e6550d"]
    middle.imshow(grid, aspect="auto", cmap=ListedColormap(action_colours), vmin=-0.5, vmax=len(actions) - 0.5,
                  interpolation="nearest", origin="lower")
    middle.set_ylabel("LLM layer")
    middle.yaxis.set_major_locator(MaxNLocator(integer=True))
    middle.legend(handles=[Patch(color=c, label=LAYER_ACTIONS[a]) for a, c in zip(actions, action_colours,
                                                                                    strict=True)],
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, title="layer (blank: no LLM pass)",
                  title_fontsize=7)
    bottom.bar(range(n), [1e3 * trace.seconds for trace in traces], width=0.9,
               color=[SOURCE_COLOURS.get(trace.source, OTHER_COLOUR) for trace in traces])
    bottom.set_ylabel("ms since the\nprevious token", fontsize=7)
    for start in np.cumsum([len(turn) for turn in split_turns(traces)])[:-1]:
        for axis in (top, middle, bottom):
            axis.axvline(start - 0.5, color="black", linewidth=1.0)
    if n <= MAX_LABELLED_TOKENS and any(trace.text for trace in traces):
        bottom.set_xticks(range(n), [repr(trace.text)[1:-1] or f"[{trace.token}]" for trace in traces],
                          rotation=90, fontsize=7)
    else:
        bottom.set_xlabel("answer token")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends right of the axes stay inside
    plt.close(fig)
    return path
