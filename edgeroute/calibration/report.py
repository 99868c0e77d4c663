"""``report.md``: the calibration's figures as tables, written beside the label shards."""

from __future__ import annotations

from pathlib import Path

from edgeroute.bundle import Calibration
from edgeroute.plots import pyplot


def _pct(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}%}"


def _routing_beside_speculation(profiles: dict) -> list[str]:
    """Per task, each route configuration next to the fastest lossless one: what routing buys
    (or costs) at the task pass it keeps."""
    lines = ["", "Routing beside lossless speculation (same held-out prompts):", "",
             "| task | route | speed vs full | LLM share | task pass (full's) | lost / gained | best lossless |",
             "|---|---|---|---|---|---|---|"]
    found = False
    for task, profile in profiles.items():
        figures = profile["figures"]
        lossless = [n for n in figures if n == "full" or n.startswith("speculate")]
        best = max(lossless, key=lambda n: figures[n]["speed_vs_full"])
        for name in (n for n in figures if n.startswith("route")):
            f, found = figures[name], True
            lines.append(f"| {task} | {name} | {f['speed_vs_full']:.2f}x | {_pct(f['llm_share'], 0)} | "
                         f"{_pct(f['task_pass'], 0)} ({_pct(f.get('full_task_pass'), 0)}) | "
                         f"{f.get('lost', '-')} / {f.get('gained', '-')} | {best} {figures[best]['speed_vs_full']:.2f}x |")
    return lines if found else []


def render(calibration: Calibration, bundle: Path, messages: list[str]) -> str:
    c = calibration
    labels = c.figures["labels"]
    slm, ngram = labels["slm"], labels["ngram"]
    lines = [f"# Calibration of `{bundle}`", "",
             f"{c.created}, edgeroute {c.edgeroute_version}, data sha256 `{c.data_sha256[:16]}`. Budget: "
             f"teacher-forced agreement with full >= {c.budget['tf_agreement']:.1%} (the SLM router: no divergent "
             f"difference kept; {c.budget['bound']} bound"
             + (f", delta {c.budget['delta']}" if c.budget.get("delta") else "") + ") for the routers' thresholds; "
             f"a task profile's loss against full's task pass at most {c.budget.get('task_loss', 0):.0%} "
             f"({c.budget.get('confidence', 0):.0%} bound on held-out prompts).", "", "## Labels", "",
             f"{labels['positions']} answer positions of {labels['prompts']} prompts.", "",
             "| light path | agree | differ | no proposal | path-checked | neutral | divergent |",
             "|---|---|---|---|---|---|---|",
             f"| slm | {slm['agree']} | {slm['differ']} | - | {slm['path_checked']} | {slm['path_neutral']} | "
             f"{slm['path_divergent']} |",
             f"| ngram | {ngram['agree']} | {ngram['differ']} | {ngram['no_proposal']} | - | - | - |", "",
             "## Routers (held-out prompts)", "",
             "| light path | candidate | AUC calibration | AUC validation | LLM share at budget (calibration) | "
             "(validation) |", "|---|---|---|---|---|---|"]
    routed = c.figures.get("routers", {})
    for light, figures in routed.items():
        for name, entry in figures["candidates"].items():
            lines.append(f"| {light} | {name} | {entry['calibration_auc'] or float('nan'):.3f} | "
                         f"{entry['validation_auc'] or float('nan'):.3f} | "
                         f"{_pct(entry['calibration_llm_share_at_budget'])} | "
                         f"{_pct(entry['validation_llm_share_at_budget'])} |")
    lines += ["", *[f"- {m}" for m in messages], "", "## Chosen routers", "",
              "| light path | router | threshold | guaranteed | held-out TF agreement | held-out LLM share |"
              " cost per token |", "|---|---|---|---|---|---|---|"]
    for light, r in c.routers.items():
        f = r.figures
        cost = f.get("cost")
        lines.append(f"| {light} | {r.router} | {r.threshold:.3f} | {_pct(1 - f['bound']['bound'], 2)} of "
                     f"{f.get('bound_unit', 'tokens')} | "
                     f"{_pct(f.get('validation_tf_agreement'), 2)} | {_pct(f.get('validation_llm_share'), 0)} | "
                     + (f"{cost['router_ms']:.3f} ms ({cost['router_ms'] / cost['slm_step_ms']:.2%} of an SLM step)"
                        if cost else "-") + " |")
    held = c.budget.get("held_out", {})
    lines += ["", "## Task profiles (runtime runs on held-out prompts)", "",
              f"Judged on {held.get('prompts', '?')} held-out prompts whose slot values occur in no calibration "
              "prompt, each with its own task check (slots, numbers, JSON values, code run against unit tests). A "
              "lossless configuration is eligible where its text equals full's on every prompt; any other only where "
              f"every prompt has a check and the bound on its loss against full is at most "
              f"{c.budget.get('task_loss', 0):.0%} (one-sided Clopper-Pearson, {c.budget.get('confidence', 0):.0%}). "
              "Tasks without a check (open dialogue) get lossless modes only.", "",
              "| task | configuration | prompts (judged) | speed vs full | LLM share | task pass (interval) | "
              "full's task pass | lost / gained | loss bound | same text as full | eligible |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, profile in c.profiles.items():
        for name, f in profile["figures"].items():
            mark = " **(chosen)**" if name == profile["config"] else ""
            eligible = profile.get("eligible", {}).get(name, {})
            low, high = f.get("pass_interval", (None, None))
            interval = f" ({_pct(low, 0)}-{_pct(high, 0)})" if f.get("task_pass") is not None else ""
            lines.append(f"| {task} | {name}{mark} | {f['prompts']} ({f.get('judged', '-')}) | "
                         f"{f['speed_vs_full']:.2f}x | {_pct(f['llm_share'], 0)} | {_pct(f['task_pass'], 0)}{interval} | "
                         f"{_pct(f.get('full_task_pass'), 0)} | {f.get('lost', '-')} / {f.get('gained', '-')} | "
                         f"{_pct(f.get('loss_bound'))} | {_pct(f['same_as_full'], 0)} | "
                         f"{'yes' if eligible.get('eligible') else 'no'}: {eligible.get('why', '-')} |")
    lines += _routing_beside_speculation(c.profiles)
    drafting = c.figures.get("drafting")
    if drafting:
        costs = drafting["costs"]
        passes = ", ".join(f"{seconds * 1e3:.1f}" for seconds in costs.get("passes", ()))
        measured = f" (passes over 1, 2, ... tokens: {passes} ms)" if passes else ""
        lines += ["", "## How the SLM drafts (speculate/slm)", "",
                  f"Measured here: SLM step {costs['slm_step'] * 1e3:.1f} ms, LLM pass {costs['llm_pass'] * 1e3:.1f} ms "
                  f"+ {costs['llm_row'] * 1e3:.1f} ms per drafted row on average{measured}. Greedy speculation "
                  "replayed over the labels, tok/s on calibration / validation prompts by draft_confidence (rows) and "
                  "longest draft (columns):"]
        lines += _draft_table(drafting["curve"])
        setting = drafting["setting"]
        chosen = {k: c.decoding[k] for k in ("draft_confidence", "draft_tokens", "max_draft_tokens") if k in c.decoding}
        lines += ["", f"Fitted: draft_confidence {setting['confidence']}, drafts of at most {setting['max_tokens']} "
                      f"tokens; replayed speed-up over the defaults on validation prompts "
                      f"{drafting['speedup_vs_default']:.3f}x; runtime runs (tok/s): {drafting.get('runtime', '-')}; "
                      f"written to the bundle: {chosen or 'nothing (defaults kept)'}."]
        per_task = drafting.get("per_task", {})
        if per_task:
            lines += ["", "Fitted on each task's answers alone (the task's profile runs speculate/slm+fitted with its "
                          "own setting where that replays faster than the overall one):", "",
                      "| task | draft_confidence | longest draft | replayed tok/s (validation) | vs the overall setting |",
                      "|---|---|---|---|---|"]
            lines += [f"| {task} | {f['setting']['confidence']} | {f['setting']['max_tokens']} | "
                      f"{f['replayed_tok_s']:.1f} | {f['replayed_vs_overall']:.3f}x |" for task, f in per_task.items()]
    lines += _tree_section(c)
    skipping = c.figures.get("skipping")
    if skipping:
        lines += ["", "## Skipping, observed on this bundle (validation prompts)", "",
                  "| granularity | scorer | AUC per decision point (min-max) | threshold | guaranteed agreement | "
                  "agreement | layer work skipped |", "|---|---|---|---|---|---|---|"]
        for granularity, figures in skipping.items():
            for scorer, entry in figures["scorers"].items():
                aucs = [a for a in entry["validation_auc"] if a is not None]  # None: one class at that point
                span = f"{min(aucs):.2f}-{max(aucs):.2f}" if aucs else "-"
                held = entry.get("validation")
                lines.append(f"| {granularity} | {scorer} | {span} | "
                             + (f"{entry['threshold']:.3f} | {_pct(1 - entry['bound'], 2)} | "
                                + (f"{_pct(held['agreement'], 2)} | {_pct(held['skipped_share'])} |" if held else
                                   "- | - |") if "threshold" in entry else "unreachable | - | - | - |"))
        lines += [""] + [f"- {granularity}: {figures['why']}; top-1 changed by a {figures['free_layers']}-layer "
                         f"skip at points {figures['points']}: "
                         + ", ".join(f"{r:.0%}" for r in figures["change_rate"])
                         for granularity, figures in skipping.items()]
    lines += ["", "![one held-out answer, token by layer](token-layers.png)", ""]
    seconds = c.figures["seconds"]
    lines += ["", "Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + ".", ""]
    return "\n".join(lines)


def plot_tradeoff(result, path: Path) -> None:
    """LLM share vs teacher-forced agreement on held-out prompts, every candidate router, and
    the chosen router's threshold."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (share, agreement) in result.curves.items():
        ax.plot(share, agreement, label=name + (" (chosen)" if name == result.router else ""),
                linewidth=2.5 if name == result.router else 1.2)
    if result.choice is not None:
        figures = result.figures
        ax.scatter([figures.get("validation_llm_share")], [figures.get("validation_tf_agreement")], color="black",
                   zorder=5, label=f"threshold {result.choice.threshold:.3f}")
        ax.axhline(1 - result.choice.alpha, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel("LLM share")
    ax.set_ylabel("teacher-forced agreement with full")
    ax.set_title(f"route/{result.light}: held-out prompts")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draft_table(curve: dict[str, dict[str, float]]) -> list[str]:
    """The replayed curve (keys ``confidence/max_tokens``) as a confidence x length table."""
    cells = {tuple(name.split("/")): rates for name, rates in curve.items()}
    confidences = sorted({c for c, _ in cells}, key=float)
    lengths = sorted({n for _, n in cells}, key=int)
    lines = ["", "| draft_confidence | " + " | ".join(f"max {n}" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for c in confidences:
        row = [f"{cells[c, n]['calibration']:.1f} / {cells[c, n]['validation']:.1f}" if (c, n) in cells else "-"
               for n in lengths]
        lines.append(f"| {c} | " + " | ".join(row) + " |")
    return lines


TREE_SECTIONS = {  # figures key: (light path, decoding key, heading, what the tree's branches are)
    "trees": ("ngram", "lookup_tree", "Draft trees of the prompt lookup",
              "the lookup's drafts as trees (its continuations where earlier matches disagree)"),
    "slm_trees": ("slm", "slm_tree", "Draft trees of the SLM",
                  "the SLM's drafts as trees (its next likeliest tokens beside its chain where it is unsure; "
                  "its fitted draft settings)"),
}


def _tree_section(c: Calibration) -> list[str]:
    """Each light path's draft trees: the replayed curve, the fitted shape and where it went."""
    lines = []
    for key, (light, decoding, heading, what) in TREE_SECTIONS.items():
        trees = c.figures.get(key)
        if not trees or not trees.get("curve"):
            continue
        shape = trees["shape"]
        fitted = "linear drafts" if shape["branches"] == 1 else f"{shape['branches']} branches, {shape['nodes']} tokens"
        written = c.decoding.get(decoding)
        lines += ["", f"## {heading} (speculate/{light})", "",
                  f"Greedy speculate/{light} replayed over the labelled answers with {what}; a pass costs the measured "
                  "pass over the tree's tokens. Tok/s on calibration / validation prompts by shape (branches x tokens):",
                  "", "| shape | calibration | validation |", "|---|---|---|"]
        lines += [f"| {name} | {v['calibration']:.1f} | {v['validation']:.1f} |" for name, v in trees["curve"].items()]
        lines += ["", f"Fitted: {fitted}; replayed speed-up over linear drafts on validation prompts "
                      f"{trees['speedup_vs_linear']:.3f}x; runtime runs (tok/s): {trees.get('runtime', '-')}; written "
                      f"to the bundle: {f'decoding.{decoding} {written}' if written else 'nothing (linear drafts kept)'}."]
        per_task = trees.get("per_task", {})
        if per_task:
            lines += ["", "| task | branches | tokens | replayed tok/s (validation) | vs the overall shape |",
                      "|---|---|---|---|---|"]
            lines += [f"| {task} | {f['shape']['branches']} | {f['shape']['nodes'] or '-'} | "
                      f"{f['replayed_tok_s']:.1f} | {f['replayed_vs_overall']:.3f}x |" for task, f in per_task.items()]
    return lines
