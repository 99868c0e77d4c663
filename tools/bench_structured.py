"""Benchmark structured output (``response_format``) on the json workload: voice command -> intent.

Same machine, one run, batch 1, greedy. Every prompt of ``tools/workloads/intents.json`` (a system
message carrying the intent's JSON schema, a spoken command) is answered by each configuration,
configurations interleaved prompt by prompt (their order rotating), so a change in the
machine's load hits all alike: compare ratios within one run.

Configurations: edgeroute ``full`` without a constraint (the baseline), and ``full``,
``speculate`` and ``route`` (n-gram and SLM light paths) with the prompt's schema as
``response_format``; llama.cpp on the bundle's LLM GGUF (``--gguf``) without and with a GBNF
grammar from the same schema (``LlamaGrammar.from_json_schema``), same thread count.

Figures, per configuration:
- **valid**: the whole answer parses as JSON and validates against the schema; **valid
  (found)**: the first ``{...}`` in the answer does (lenient to unconstrained prose around it);
  **correct**: the parsed intent equals the expected one (strings case-insensitive).
- **forced**: share of generated tokens the grammar forced (no model step).
- **decode tok/s**: tokens after the first one that needed a model pass (the prefill's), over
  the time after it, pooled over prompts; **x full**: median over prompts of the ratio to
  unconstrained ``full`` on the same prompt. Caveat: with SLM drafts, the SLM's prefill and its
  drafting before the first LLM pass fall outside this span (an intent drafted whole and checked
  in the prefill pass has no decode span at all).
- **x full after prefill**: the same ratio with every cost but the LLM's prefill counted:
  (tokens - 1) / (wall time - unconstrained ``full``'s prefill time on the same prompt), over
  ``full``'s decode rate. **latency**: median wall time per answer from the call to the last
  token (grammar compile, prefill and all); **latency x full**: median per-prompt ratio.
- **mask ms/tok**: time in the grammar (masks, forced tokens, draft checks) per generated token.
- **passes/tok**: LLM passes per generated token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edgeroute.files import atomic_write  # noqa: E402
from edgeroute.llamacpp import Unavailable, source_gguf  # noqa: E402
from tools.benchlib.llama import checked_gguf, greedy_tokens, open_llama  # noqa: E402

EDGEROUTE_CONFIGS = {
    "full": dict(mode="full"),
    "full+schema": dict(mode="full", constrained=True),
    "speculate-ngram+schema": dict(mode="speculate", light="ngram", constrained=True),
    "speculate-slm+schema": dict(mode="speculate", light="slm", constrained=True),
    "route-ngram+schema": dict(mode="route", light="ngram", constrained=True),
    "route-slm+schema": dict(mode="route", light="slm", constrained=True),
    "route-slm-verified+schema": dict(mode="route", light="slm", route_check="verified", constrained=True),
    "auto+schema": dict(mode="auto", task="json", constrained=True),  # the json task profile's calibrated choice
}
LLAMA_CONFIGS = {"llama.cpp": False, "llama.cpp+gbnf": True}


@dataclass
class Answer:
    text: str
    tokens: int
    wall: float  # call to last token
    decode_tokens: int  # after the first token that needed a model pass
    decode_seconds: float
    forced: int = 0
    grammar_seconds: float = 0.0
    llm_calls: int = 0
    finish: str = ""
    sources: dict[str, int] = field(default_factory=dict)


def _decode_span(seconds: list[float], needed_model: list[bool]) -> tuple[int, float]:
    first = needed_model.index(True) if True in needed_model else len(seconds) - 1
    return len(seconds) - first - 1, float(sum(seconds[first + 1:]))


class EdgerouteRunner:
    def __init__(self, engine, budget: int, draft_tokens: int, max_draft_tokens: int, layout: str = "model") -> None:
        self.engine, self.budget, self.layout = engine, budget, layout
        self.draft = dict(draft_tokens=draft_tokens, max_draft_tokens=max_draft_tokens)

    def answer(self, prompt: dict, config: dict, budget: int | None = None) -> Answer:
        options = {k: v for k, v in config.items() if k != "constrained"}
        if config.get("constrained"):
            options["response_format"] = {"type": "json_schema", "json_schema": {"schema": prompt["schema"]},
                                          "layout": self.layout}
            if options["mode"] in ("route", "auto"):
                options["protect_format"] = True  # as the json task profile routes: structure never from the SLM
        session = self.engine.session(max_new_tokens=budget or self.budget, **options, **self.draft)
        start = time.perf_counter()
        text = "".join(session.stream(prompt["messages"]))
        wall = time.perf_counter() - start
        generation = session.last
        trace, stats = generation.trace, generation.stats
        sources: dict[str, int] = {}
        for t in trace:
            sources[t.source] = sources.get(t.source, 0) + 1
        n, seconds = _decode_span([t.seconds for t in trace], [t.source != "grammar" for t in trace])
        return Answer(text, len(trace), wall, n, seconds, stats.forced, stats.grammar_seconds, stats.llm_calls,
                      generation.finish_reason, sources)


class LlamaRunner:
    def __init__(self, gguf: Path, threads: int, n_ctx: int, budget: int) -> None:
        self.llm = open_llama(gguf, threads, n_ctx)
        self.budget = budget

    def answer(self, ids: list[int], eos_ids: set[int], schema: dict | None, decode) -> Answer:
        from llama_cpp import LlamaGrammar

        start = time.perf_counter()
        grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False) if schema is not None else None
        tokens, seconds = greedy_tokens(self.llm, ids, eos_ids, self.budget, grammar)
        wall = time.perf_counter() - start
        n, decode_seconds = _decode_span(seconds, [True] * len(seconds))
        finish = "eos" if tokens and tokens[-1] in eos_ids else "length"
        return Answer(decode([t for t in tokens if t not in eos_ids]), len(tokens), wall, n, decode_seconds,
                      llm_calls=len(tokens), finish=finish, sources={"llm": len(tokens)})


# -- checks -------------------------------------------------------------------------------------

def _valid(value, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def parse_strict(text: str):
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None


def parse_found(text: str):
    """The first JSON object in the text (models wrap answers in prose or ``` fences)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            return decoder.raw_decode(text[match.start():])[0]
        except json.JSONDecodeError:
            continue
    return None


def _normal(value):
    return value.strip().lower() if isinstance(value, str) else value


def checks(answer: Answer, prompt: dict) -> dict:
    strict, found = parse_strict(answer.text), parse_found(answer.text)
    valid = strict is not None and _valid(strict, prompt["schema"])
    valid_found = found is not None and _valid(found, prompt["schema"])
    correct = valid_found and isinstance(found, dict) and \
        {k: _normal(v) for k, v in found.items()} == {k: _normal(v) for k, v in prompt["expected"].items()}
    return {"valid": valid, "valid_found": valid_found, "correct": correct}


# -- the grammar alone -----------------------------------------------------------------------------

def grammar_costs(engine, prompts: list[dict]) -> dict:
    """Compile time per schema and mask time per position, walking each expected intent (in
    minified JSON) through its constraint: forced tokens where forced, else the tokenizer's
    next token of the remaining text. Also the share of the intents' tokens that are forced,
    a property of schema and tokenizer alone."""
    compile_ms, mask_ms, forced, total, complete = [], [], 0, 0, 0
    assert engine.grammars.tokenizer is not None  # built once per engine (not timed): not per request
    for prompt in prompts:
        start = time.perf_counter()
        constraint = engine.grammars.compile({"type": "json_schema", "schema": prompt["schema"]})
        compile_ms.append((time.perf_counter() - start) * 1000)
        text, tokens = json.dumps(prompt["expected"], separators=(",", ":"), ensure_ascii=False), []
        while (token := constraint.forced()) != constraint.eos_id:
            start = time.perf_counter()
            allowed = constraint.allowed()
            mask_ms.append((time.perf_counter() - start) * 1000)
            if token is None:
                token = engine.encode(text[len(engine.decode(tokens)):])[0]
                if not allowed[token]:
                    break  # the tokenizer's split is not the grammar's here: stop this walk
            else:
                forced += 1
            constraint.advance(token)
            tokens.append(token)
        total += len(tokens)
        complete += constraint.complete
    return {"schemas": len(prompts), "walks_complete": complete, "compile_ms_median": statistics.median(compile_ms),
            "mask_ms_median": statistics.median(mask_ms), "mask_ms_p90": statistics.quantiles(mask_ms, n=10)[-1],
            "forced_share_of_expected": forced / total if total else 0.0}


# -- the run ------------------------------------------------------------------------------------

def _rate(tokens: int, seconds: float) -> float | None:
    """Tokens per second; None when nothing was timed (an answer the grammar forced whole),
    which the ratios leave out rather than count as infinitely fast."""
    return tokens / seconds if seconds > 0 else None


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def summarize(records: list[dict], full: dict[str, dict]) -> dict:
    """One configuration's figures; ``full``: unconstrained full's record per prompt id."""
    tokens = sum(r["tokens"] for r in records)
    decode_tokens, decode_seconds = sum(r["decode_tokens"] for r in records), sum(r["decode_seconds"] for r in records)
    base = {i: _rate(f["decode_tokens"], f["decode_seconds"]) for i, f in full.items()}
    ratios = [_ratio(_rate(r["decode_tokens"], r["decode_seconds"]), base[r["id"]]) for r in records if r["id"] in base]
    ratios = [x for x in ratios if x is not None]
    after_prefill = [_ratio(_rate(r["tokens"] - 1, r["wall"] - (full[r["id"]]["wall"] - full[r["id"]]["decode_seconds"])),
                            base[r["id"]]) for r in records if r["id"] in base]
    after_prefill = [x for x in after_prefill if x is not None]
    latency = [r["wall"] / full[r["id"]]["wall"] for r in records if r["id"] in full]
    n = len(records)
    return {
        "prompts": n,
        "valid": sum(r["valid"] for r in records) / n,
        "valid_found": sum(r["valid_found"] for r in records) / n,
        "correct": sum(r["correct"] for r in records) / n,
        "incomplete": sum(r["finish"] == "incomplete" for r in records),
        "tokens_per_answer": tokens / n,
        "forced_share": sum(r["forced"] for r in records) / tokens if tokens else 0.0,
        "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else None,
        "x_full_median": statistics.median(ratios) if ratios else None,
        "x_full_after_prefill_median": statistics.median(after_prefill) if after_prefill else None,
        "latency_median_ms": statistics.median(r["wall"] for r in records) * 1000,
        "latency_x_full_median": statistics.median(latency) if latency else None,
        "mask_ms_per_token": sum(r["grammar_seconds"] for r in records) / tokens * 1000 if tokens else 0.0,
        "llm_passes_per_token": sum(r["llm_calls"] for r in records) / tokens if tokens else 0.0,
    }


def print_table(summary: dict[str, dict], title: str, console: Console) -> None:
    table = Table(title=title)
    columns = [("config", None, ""), ("valid", "valid", "{:.0%}"), ("valid (found)", "valid_found", "{:.0%}"),
               ("correct", "correct", "{:.0%}"), ("incompl.", "incomplete", "{}"),
               ("tok/answer", "tokens_per_answer", "{:.1f}"), ("forced", "forced_share", "{:.0%}"),
               ("decode tok/s", "decode_tok_s", "{:.1f}"), ("x full", "x_full_median", "{:.2f}"),
               ("x full after prefill", "x_full_after_prefill_median", "{:.2f}"),
               ("latency ms", "latency_median_ms", "{:.0f}"), ("latency x full", "latency_x_full_median", "{:.2f}"),
               ("mask ms/tok", "mask_ms_per_token", "{:.3f}"),
               ("passes/tok", "llm_passes_per_token", "{:.2f}")]
    for name, _, _ in columns:
        table.add_column(name, justify="left" if name == "config" else "right")
    for config, row in summary.items():
        table.add_row(config, *["-" if row.get(key) is None else fmt.format(row[key]) for _, key, fmt in columns[1:]])
    console.print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, default=REPO / "bundles" / "smollm2-demo")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the LLM's source GGUF for the llama.cpp rows (default: the path the bundle recorded, "
                             "if it is on this machine; a file given here must be that source, checked by sha256)")
    parser.add_argument("--no-llama", action="store_true", help="leave the llama.cpp rows out")
    parser.add_argument("--workload", type=Path, default=REPO / "tools" / "workloads" / "intents.json")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--layout", choices=("model", "compact"), default="model",
                        help="JSON layout of the constrained runs (model: the json task profile's)")
    parser.add_argument("--draft-tokens", type=int, default=6)
    parser.add_argument("--max-draft-tokens", type=int, default=24)
    parser.add_argument("--configs", default=",".join([*EDGEROUTE_CONFIGS, *LLAMA_CONFIGS]))
    parser.add_argument("--threads", type=int, default=int(os.environ.get("EDGEROUTE_THREADS", 0)) or os.cpu_count())
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "structured.json")
    parser.add_argument("--report", type=Path, default=None, help="print the tables of an earlier run's JSON")
    return parser.parse_args(argv)


def report(path: Path, console: Console) -> int:
    result = json.loads(path.read_text())
    records = result["records"]
    full = {r["id"]: r for r in records.get("full", [])}
    summary = {c: summarize(rs, full) for c, rs in records.items()}
    print_table(summary, f"json workload, {result['prompts']} prompts, {Path(result['bundle']).name}, "
                         f"{result['threads']} threads, {result['created']}", console)
    if result.get("grammar"):
        console.print(f"grammar alone: {result['grammar']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=200)
    if args.report is not None:
        return report(args.report, console)
    os.environ.setdefault("EDGEROUTE_THREADS", str(args.threads))
    from edgeroute.runtime import Engine

    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(EDGEROUTE_CONFIGS) - set(LLAMA_CONFIGS)
    if unknown:
        console.print(f"[red]unknown configs: {', '.join(sorted(unknown))}[/]")
        return 2
    prompts = json.loads(args.workload.read_text())["prompts"][:args.limit]
    engine = Engine(args.bundle, verify=False)
    if engine.bundle.slm is None:
        configs = [c for c in configs if "slm" not in c]
    if engine.bundle.calibration is None and any(EDGEROUTE_CONFIGS.get(c, {}).get("mode") == "auto" for c in configs):
        console.print("[yellow]auto left out: the bundle is not calibrated (edgeroute calibrate)[/]")
        configs = [c for c in configs if EDGEROUTE_CONFIGS.get(c, {}).get("mode") != "auto"]
    runner = EdgerouteRunner(engine, args.max_new_tokens, args.draft_tokens, args.max_draft_tokens, args.layout)
    llama = None
    if not args.no_llama and any(c in LLAMA_CONFIGS for c in configs):
        if args.gguf is None:  # the bundle's recorded source, where it is on this machine; else no llama.cpp rows
            try:
                args.gguf = source_gguf(engine.bundle, "llm")
            except Unavailable as err:
                console.print(f"[yellow]no llama.cpp rows: {err}[/]")
        else:  # a file given must be that source
            args.gguf = checked_gguf(engine.bundle, "llm", args.gguf)
    if args.gguf is not None and not args.no_llama and any(c in LLAMA_CONFIGS for c in configs):
        llama = LlamaRunner(args.gguf, args.threads, int(engine.bundle.generation["context_length"]),
                            args.max_new_tokens)
    configs = [c for c in configs if c in EDGEROUTE_CONFIGS or llama is not None]
    # warm-up: the sessions' first runs, the grammar's tokenizer, the SLM
    for config in configs:
        if config in EDGEROUTE_CONFIGS:
            runner.answer(prompts[0], EDGEROUTE_CONFIGS[config], budget=8)
    records: dict[str, list[dict]] = {c: [] for c in configs}
    for i, prompt in enumerate(prompts):
        ids = engine.encode_prompt(prompt["messages"])
        for config in configs[i % len(configs):] + configs[:i % len(configs)]:
            if config in EDGEROUTE_CONFIGS:
                answer = runner.answer(prompt, EDGEROUTE_CONFIGS[config])
            else:
                answer = llama.answer(ids, engine.eos_ids, prompt["schema"] if LLAMA_CONFIGS[config] else None,
                                      engine.decode)
            records[config].append({"id": prompt["id"], **asdict(answer), **checks(answer, prompt)})
        console.print(f"[dim]{i + 1}/{len(prompts)} {prompt['id']}: "
                      f"{records[configs[0]][-1]['text'][:60]!r} ...[/]")
    costs = grammar_costs(engine, prompts)
    console.print(f"grammar alone, {costs['schemas']} schemas: compile {costs['compile_ms_median']:.1f} ms (median), "
                  f"mask {costs['mask_ms_median']:.3f} ms median / {costs['mask_ms_p90']:.3f} ms p90 per position; "
                  f"{costs['forced_share_of_expected']:.0%} of the expected intents' tokens are forced")
    full = {r["id"]: r for r in records.get("full", [])}
    summary = {c: summarize(records[c], full) for c in configs}
    title = f"json workload, {len(prompts)} prompts, {args.bundle.name}, {args.threads} threads (shared machine)"
    print_table(summary, title, console)
    result = {"bundle": str(args.bundle), "gguf": str(args.gguf) if args.gguf else None, "prompts": len(prompts),
              "layout": args.layout,
              "max_new_tokens": args.max_new_tokens, "threads": args.threads, "machine": platform.platform(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "summary": summary, "grammar": costs,
              "records": records}
    atomic_write(args.out, json.dumps(result, indent=1))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
