"""Structured output (response_format): on the tiny random models, whose unconstrained output is
random tokens, every answer parses and validates only because the constraint works."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from typer.testing import CliRunner

from edgeroute.cli import app
from edgeroute.errors import InputError
from edgeroute.runtime.constraints import Constraint, ResponseFormat
from edgeroute.runtime.profiles import load_profile

INTENT = {
    "type": "object",
    "properties": {
        "action": {"enum": ["set", "increase", "decrease", "off"]},
        "zone": {"enum": ["driver", "passenger", "rear", "all"]},
        "temperature_c": {"type": "integer", "minimum": 16, "maximum": 30},
        "note": {"type": "string", "maxLength": 6},
        "recirculate": {"type": "boolean"},
    },
    "required": ["action", "zone", "temperature_c", "note", "recirculate"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"schema": INTENT}}
PROMPTS = [
    "Set the passenger side to twenty-one degrees. JSON:",
    "Make it warmer in the back. JSON:",
    '{"action":"set","zone":"driver","temperature_c":19,"note":"","recirculate":true} again:',
]
NEW = 64
MODES = {
    "full": dict(mode="full"),
    "slm": dict(mode="slm"),
    "route-ngram": dict(mode="route"),
    "route-slm": dict(mode="route", light="slm"),
    "speculate-ngram": dict(mode="speculate"),
    "speculate-slm": dict(mode="speculate", light="slm"),
    "speculate-ngram+slm": dict(mode="speculate", light="ngram+slm"),
    "skip": dict(mode="skip", scorer="random", skip_ratio=0.5, protected_first=1, protected_last=0,
                 max_free_layers=1, re_eval_interval=1, fallback=None),
    "speculate+skip": dict(mode="speculate+skip", scorer="random", skip_ratio=0.5, protected_first=1,
                           protected_last=0, max_free_layers=1, re_eval_interval=1),
}


def parses_and_validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def unforced(monkeypatch):
    """Runs after this decode every token with a model step: the grammar still masks, but
    forces nothing (the reference a free forced token must reproduce)."""
    monkeypatch.setattr(Constraint, "forced", lambda self: None)


@pytest.fixture(scope="module")
def unconstrained(tiny_engine) -> dict[str, str]:
    return {p: tiny_engine.generate(p, max_new_tokens=NEW).text for p in PROMPTS}


def test_unconstrained_tiny_model_output_is_not_valid_json(unconstrained):
    assert not any(parses_and_validates(text, INTENT) for text in unconstrained.values()), \
        "the tiny model writes valid intents on its own: the tests below would prove nothing"


@pytest.mark.parametrize("variant", MODES)
def test_output_parses_and_validates_against_the_schema_in_every_mode(variant, tiny_engine):
    for prompt in PROMPTS:
        got = tiny_engine.generate(prompt, max_new_tokens=NEW, response_format=FORMAT, **MODES[variant])
        assert got.finish_reason == "eos", (variant, prompt, got.text)
        assert parses_and_validates(got.text, INTENT), (variant, prompt, got.text)
        assert got.stats.forced == sum(t.source == "grammar" for t in got.trace) > 0


@pytest.mark.parametrize("mode", ["full", "speculate"])
def test_sampled_output_is_valid_too(mode, tiny_engine):
    for seed in range(3):
        got = tiny_engine.generate(PROMPTS[0], max_new_tokens=NEW, response_format=FORMAT, mode=mode,
                                   temperature=1.0, seed=seed)
        assert parses_and_validates(got.text, INTENT), got.text


@pytest.mark.parametrize("variant", ["full", "speculate-ngram", "speculate-slm", "speculate-ngram+slm", "route-ngram"])
def test_forced_tokens_are_exactly_the_tokens_a_masked_full_run_picks(variant, tiny_engine, monkeypatch):
    """Free forced tokens (and, for speculation, masked drafts) change no token: the reference
    runs a masked LLM step for every token. Route with the n-gram router is lossy in general,
    but on these prompts the LLM is called wherever the router doubts."""
    fast = {p: tiny_engine.generate(p, max_new_tokens=NEW, response_format=FORMAT, **MODES[variant]) for p in PROMPTS}
    with monkeypatch.context() as patch:
        unforced(patch)
        masked = {p: tiny_engine.generate(p, max_new_tokens=NEW, response_format=FORMAT) for p in PROMPTS}
    for prompt in PROMPTS:
        assert masked[prompt].stats.forced == 0
        assert fast[prompt].stats.forced > 0
        if variant == "route-ngram" and any(t.source == "ngram" for t in fast[prompt].trace):
            continue  # a light token the router let through: not the LLM's choice by design
        assert fast[prompt].tokens == masked[prompt].tokens, (variant, prompt)


def test_speculation_with_a_grammar_accepts_drafts_and_counts_forced_tokens_apart(tiny_engine):
    prompt = PROMPTS[2]  # the intent's keys are in the prompt: n-gram drafts copy them
    got = tiny_engine.generate(prompt, max_new_tokens=NEW, response_format=FORMAT, mode="speculate")
    sources = [t.source for t in got.trace]
    assert "draft:ngram" in sources or got.stats.drafted > 0
    assert got.stats.accepted == sources.count("draft:ngram")
    assert got.stats.forced == sources.count("grammar")


def walk(constraint: Constraint, engine, text: str) -> tuple[list[int], int]:
    """Follow ``text`` through the grammar: the forced token where there is one, else the
    longest allowed token that continues the text. Checks the mask on every step."""
    tokens, forced = [], 0
    while True:
        allowed = constraint.allowed()
        token = constraint.forced()
        if token == constraint.eos_id:
            assert engine.decode(tokens) == text
            return tokens, forced
        if token is not None:
            assert np.flatnonzero(allowed).tolist() == [token], "the mask allows more than the forced token"
            forced += 1
        else:
            rest = text[len(engine.decode(tokens)):]
            fitting = [int(t) for t in np.flatnonzero(allowed) if engine.decode([int(t)])
                       and rest.startswith(engine.decode([int(t)]))]
            assert fitting, f"the mask removed every token that continues {rest!r}"
            token = max(fitting, key=lambda t: len(engine.decode([t])))
        assert engine.decode([*tokens, token]) == text[:len(engine.decode([*tokens, token]))]
        constraint.advance(token)
        tokens.append(token)


@pytest.mark.parametrize("intent", [
    {"action": "set", "zone": "passenger", "temperature_c": 21, "note": "", "recirculate": False},
    {"action": "off", "zone": "all", "temperature_c": 16, "note": "cold!", "recirculate": True},
    {"action": "decrease", "zone": "rear", "temperature_c": 30, "note": "é \"x\"", "recirculate": False},
])
def test_mask_never_removes_the_token_a_valid_output_needs(intent, tiny_engine):
    constraint = tiny_engine.grammars.compile(FORMAT)
    text = json.dumps(intent, ensure_ascii=False, separators=(",", ":"))
    tokens, forced = walk(constraint, tiny_engine, text)
    assert constraint.complete and forced >= len(tokens) // 3


def test_invalid_text_is_rejected_by_the_mask(tiny_engine):
    constraint = tiny_engine.grammars.compile(FORMAT)
    with pytest.raises(AssertionError, match="removed every token"):
        walk(constraint, tiny_engine, '{"action":"heat"}')


@pytest.mark.parametrize(("spec", "check"), [
    ({"type": "regex", "regex": r"(left|right) lane, [1-9][0-9]? km"},
     lambda t: re.fullmatch(r"(left|right) lane, [1-9][0-9]? km", t)),
    ({"type": "grammar", "grammar": 'root ::= "turn " ("on" | "off") " the " ("lights" | "radio")'},  # GBNF
     lambda t: t in {f"turn {a} the {b}" for a in ("on", "off") for b in ("lights", "radio")}),
    ({"type": "grammar", "grammar": 'start: "zone=" ZONE\nZONE: "driver" | "passenger"'},  # Lark
     lambda t: t in ("zone=driver", "zone=passenger")),
    ({"type": "json_schema", "schema": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "minItems": 2, "maxItems": 3}},
     lambda t: 2 <= len(json.loads(t)) <= 3 and all(0 <= v <= 9 for v in json.loads(t))),
])
def test_regex_and_grammars_constrain_the_output(spec, check, tiny_engine):
    for mode in ("full", "speculate"):
        got = tiny_engine.generate(PROMPTS[0], max_new_tokens=NEW, response_format=spec, mode=mode)
        assert got.finish_reason == "eos" and check(got.text), (mode, got.text)


def test_chat_turns_each_follow_the_format(tiny_engine):
    chat = tiny_engine.chat(mode="speculate", response_format=FORMAT, max_new_tokens=NEW)
    for turn in ("Warmer for the driver", "And the passenger?"):
        got = chat.generate(turn)
        assert got.finish_reason == "eos" and parses_and_validates(got.text, INTENT), got.text


@pytest.mark.parametrize(("spec", "message"), [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "JSON schema does not compile"),
    ({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
     "JSON schema does not compile"),
    ({"type": "regex", "regex": "[a-z"}, "regex does not compile"),
    ({"type": "grammar", "grammar": 'start: "yes" | foo'}, "grammar does not compile"),
    ({"type": "xml"}, "response_format type 'xml' is not one of"),
    ({"type": "json_schema"}, "needs a schema object"),
    ({"type": "regex", "regex": ""}, "regex needs its text"),
    ("json", "response_format type 'json' is not one of"),
    ({"type": "json_schema", "schema": {"type": "string", "enum": {"driver", "passenger"}}},
     r"the JSON schema is not JSON \(Object of type set"),
    ({"type": "json_object", "layout": "model", "schema": {"type": "object", "x-guidance": True}},
     '"x-guidance" must be an object of options'),
    ({"type": "json_schema", "json_schema": {"schema": False}}, "the JSON schema false allows no value at all"),
    ({"type": "json_schema", "schema": False, "layout": "model"}, "the JSON schema false allows no value at all"),
])
def test_bad_formats_are_clear_input_errors_and_change_nothing(spec, message, tiny_engine):
    session = tiny_engine.session()
    with pytest.raises(InputError, match=message):
        session.generate(PROMPTS[0], max_new_tokens=4, response_format=spec)
    assert session.state.tokens == [] and session.last is None


def test_stop_strings_with_a_format_are_an_input_error(tiny_engine):
    with pytest.raises(InputError, match="stop strings"):
        tiny_engine.generate(PROMPTS[0], response_format=FORMAT, stop=("}",))


@pytest.mark.parametrize("mode", ["full", "speculate", "route"])
def test_a_structure_cut_by_max_tokens_is_reported_incomplete(mode, tiny_engine):
    got = tiny_engine.generate(PROMPTS[0], max_new_tokens=6, response_format=FORMAT, mode=mode)
    assert got.finish_reason == "incomplete"
    assert not parses_and_validates(got.text, INTENT)
    plain = tiny_engine.generate(PROMPTS[0], max_new_tokens=6, mode=mode)
    assert plain.finish_reason == "length"


def test_a_structure_that_ends_at_the_token_budget_is_whole_not_cut(tiny_engine):
    whole = tiny_engine.generate(PROMPTS[0], max_new_tokens=NEW, response_format=FORMAT)
    assert whole.finish_reason == "eos" and whole.trace[-1].source == "grammar"  # the end-of-sequence token forced
    at_end = tiny_engine.generate(PROMPTS[0], max_new_tokens=len(whole.tokens) - 1, response_format=FORMAT)
    assert at_end.finish_reason == "eos" and at_end.text == whole.text


def test_response_format_parses_openai_and_short_forms():
    schema = {"type": "object"}
    assert ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) == \
        ResponseFormat.parse({"type": "json_schema", "schema": schema}) == ResponseFormat.json_schema(schema)
    assert ResponseFormat.parse({"type": "json_object"}) == ResponseFormat.json_schema(schema)
    assert ResponseFormat.parse({"type": "text"}) is None and ResponseFormat.parse(None) is None


def test_json_profile_constrains_to_a_json_object(tiny_slm_bundle):
    decoding = load_profile("json").decoding
    assert ResponseFormat.parse(decoding["response_format"]) == ResponseFormat.json_schema({"type": "object"}, "model")


runner = CliRunner()


def test_cli_json_schema_answers_valid_json_and_traces_grammar_tokens(tiny_slm_bundle, tmp_path):
    schema, trace = tmp_path / "intent.json", tmp_path / "trace.jsonl"
    schema.write_text(json.dumps(INTENT))
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", PROMPTS[0], "--raw", "--max-new-tokens", str(NEW),
                                 "--json-schema", str(schema), "--profile", "json", "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    answer = result.stdout.strip().splitlines()[0]
    assert parses_and_validates(answer, INTENT), answer
    sources = [json.loads(line)["source"] for line in trace.read_text().splitlines()]
    assert "grammar" in sources and "forced by the grammar" in result.output


def test_cli_truncated_structure_exits_3_with_an_error(tiny_slm_bundle, tmp_path):
    schema = tmp_path / "intent.json"
    schema.write_text(json.dumps(INTENT))
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", PROMPTS[0], "--raw", "--max-new-tokens", "5",
                                 "--json-schema", str(schema)])
    assert result.exit_code == 3, result.output
    assert "incomplete" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--json-schema", "nosuch.json"], "cannot read the JSON schema file"),
    (["--regex", "a+", "--grammar", "g.lark"], "give one of --json-schema, --regex, --grammar"),
    (["--regex", "(a"], "regex does not compile"),
])
def test_cli_bad_structure_options_are_clear_errors(args, message, tiny_slm_bundle):
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "hi", "--raw", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_constraining_a_proposal_keeps_what_routers_read(tiny_engine):
    from edgeroute.runtime.drafters import Proposal

    constraint = tiny_engine.grammars.compile(FORMAT)
    allowed = np.flatnonzero(constraint.allowed())
    refused = int(np.flatnonzero(~constraint.allowed())[0])
    probabilities = np.full(constraint.vocab_size, 1.0 / constraint.vocab_size)
    hidden = np.arange(4, dtype=np.float32)
    slm = constraint.constrain(Proposal([refused], [probabilities], hidden=[hidden], answer_position=5))
    assert slm.tokens[0] in allowed and slm.hidden == [hidden] and slm.answer_position == 5
    ngram = constraint.constrain(Proposal([int(allowed[0])], [None], match_length=3, match_count=2, answer_position=4))
    assert (ngram.tokens, ngram.match_length, ngram.match_count, ngram.answer_position) == ([int(allowed[0])], 3, 2, 4)
    assert constraint.constrain(Proposal([refused], [None], answer_position=4)).tokens == []


def test_route_with_a_trained_slm_router_under_a_schema(tiny_engine):
    """The trained router reads the SLM's hidden state of the constrained proposal (it was dropped:
    IndexError on the calibrated pair)."""
    from edgeroute.calibration.train import TrainSettings, router_onnx, train_router
    from edgeroute.runtime.routers import SLM_FEATURES, TrainedRouter, slm_features

    slm = tiny_engine.slm
    width = slm_features(np.zeros(slm.arch.hidden_size), np.full(8, 0.125)).shape[0]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, width)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)
    net, _ = train_router(x, y, x, y, TrainSettings(hidden_units=0, epochs=2))
    router = TrainedRouter(router_onnx(net), SLM_FEATURES)
    got = tiny_engine.generate(PROMPTS[0], max_new_tokens=NEW, response_format=FORMAT, mode="route", light="slm",
                               router=router, route_threshold=0.5)
    assert parses_and_validates(got.text, INTENT)
    scored = [t.router_score for t in got.trace if t.router_score is not None]
    assert scored and any(0.0 < s < 1.0 for s in scored)  # scored by the net, not the "no features" fallback


def follow(constraint: Constraint, engine, text: str) -> bool:
    """Whether the grammar allows ``text`` (its tokens, one by one) and is complete after it."""
    for token in engine.encode(text):
        if not constraint.allowed()[token]:
            return False
        constraint.advance(token)
    return constraint.complete


PRETTY = '{\n  "action": "set",\n  "zone": "rear",\n  "temperature_c": 21,\n  "note": "",\n  "recirculate": false\n}'


@pytest.mark.parametrize("text", [PRETTY, f"```json\n{PRETTY}\n```", json.dumps(json.loads(PRETTY))])
def test_the_model_layout_takes_the_models_own_whitespace_and_a_fence(text, tiny_engine):
    assert follow(tiny_engine.grammars.compile({**FORMAT, "layout": "model"}), tiny_engine, text)


def test_the_model_layout_still_holds_the_schema_and_the_compact_one_its_layout(tiny_engine):
    wrong_value = PRETTY.replace('"rear"', '"roof"')
    assert not follow(tiny_engine.grammars.compile({**FORMAT, "layout": "model"}), tiny_engine, wrong_value)
    assert not follow(tiny_engine.grammars.compile({**FORMAT, "layout": "model"}), tiny_engine, f"Sure: {PRETTY}")
    assert not follow(tiny_engine.grammars.compile(FORMAT), tiny_engine, PRETTY)
    with pytest.raises(InputError, match="layout 'pretty'"):
        tiny_engine.grammars.compile({**FORMAT, "layout": "pretty"})


@pytest.mark.parametrize("layout, texts", [
    ("compact", ['{"a":[1,2]}', '[true,null]', '"left"', "21", "false"]),
    ("model", ['{\n  "a": [1, 2]\n}', "[ true, null ]", '"left"', "```json\n21\n```"]),
])
def test_the_schema_true_takes_any_json_value_in_either_layout(layout, texts, tiny_engine):
    for spec in ({"type": "json_schema", "json_schema": {"schema": True}, "layout": layout},
                 ResponseFormat.json_schema("true", layout)):  # the schema as JSON text
        for text in texts:
            assert follow(tiny_engine.grammars.compile(spec), tiny_engine, text), (spec, text)
        assert not follow(tiny_engine.grammars.compile(spec), tiny_engine, "left lane")
