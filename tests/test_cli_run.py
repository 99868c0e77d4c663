"""`edgeroute run`: the CLI over the Engine API (modes, profiles, trace, errors)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from edgeroute.bundle import Bundle
from edgeroute.cli import app
from edgeroute.errors import InputError
from edgeroute.runtime import AnswerMemory, Engine, EngineOptions
from tests.conftest import export_tiny

runner = CliRunner()


def test_run_speculate_writes_one_trace_line_per_token_and_a_summary(tiny_slm_bundle, tmp_path):
    trace = tmp_path / "trace.jsonl"
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "one two three one two", "--raw",
                                 "--mode", "speculate", "--max-new-tokens", "12", "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == 12
    assert {r["source"] for r in records} <= {"llm", "draft:ngram"}
    assert "mode speculate" in result.output.replace("\n", " ")
    assert f"edgeroute trace {trace}" in result.output.replace("\n", "")


def test_run_logit_bias_takes_json_token_ids_and_refuses_what_is_not_an_object(tiny_slm_bundle, tmp_path):
    trace = tmp_path / "trace.jsonl"
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "one two three", "--raw", "--mode",
                                 "speculate", "--max-new-tokens", "5", "--logit-bias", '{"42": 100}', "--trace",
                                 str(trace)])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["token"] for line in trace.read_text().splitlines()] == [42] * 5
    for bad, said in (("[42]", "JSON object"), ("{42: 1}", "JSON object"), ('{"42": 500}', "within [-100, 100]")):
        refused = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "one", "--logit-bias", bad])
        assert refused.exit_code == 2 and said in refused.output.replace("\n", " "), refused.output


def test_run_keeps_its_answers_in_a_memory_file_that_the_next_run_drafts_from(tiny_slm_bundle, tmp_path):
    memory = tmp_path / "memory.npz"
    command = ["run", str(tiny_slm_bundle), "--prompt", "one two three one two", "--raw", "--mode", "speculate",
               "--light", "ngram", "--max-new-tokens", "12", "--memory", str(memory)]
    first = runner.invoke(app, command)
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, command)
    assert again.exit_code == 0, again.output
    assert AnswerMemory.load(memory).answers() == 2
    assert first.output.splitlines()[0] == again.output.splitlines()[0]  # the same answer, exactly
    drafted = [float(line.split("draft acceptance ")[1].split("%")[0]) if "draft acceptance" in line else 0.0
               for line in (" ".join(r.output.split()) for r in (first, again))]
    assert drafted[1] > drafted[0]  # the second run drafted the first one's answer
    both = runner.invoke(app, [*command, "--no-memory"])
    assert both.exit_code != 0 and "contradict" in both.output


def test_run_refuses_a_memory_file_of_another_vocabulary_and_leaves_it_as_it_was(tiny_slm_bundle, tmp_path):
    vocab = Bundle.open(tiny_slm_bundle).llm.arch.vocab_size
    foreign = AnswerMemory()
    foreign.remember(None, [5, vocab + 7, 6])
    memory = tmp_path / "memory.npz"
    foreign.save(memory)
    kept = memory.read_bytes()
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "one two", "--raw", "--mode", "speculate",
                                 "--light", "ngram", "--max-new-tokens", "4", "--memory", str(memory)])
    assert result.exit_code != 0
    said = " ".join(result.output.split())
    assert f"token id {vocab + 7}, outside this bundle's vocabulary of {vocab}" in said
    assert memory.read_bytes() == kept


def test_run_output_equals_the_api_in_full_mode(tiny_slm_bundle, tiny_engine):
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "Hello there", "--raw", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert tiny_engine.generate("Hello there", max_new_tokens=8).text in result.output


def test_run_takes_a_task_profile(tiny_slm_bundle):
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "a b a b a", "--raw", "--max-new-tokens", "6",
                                 "--profile", "cpu,templated"])
    assert result.exit_code == 0, result.output
    assert "mode speculate" in result.output.replace("\n", " ")


def test_attention_kv_dtype_and_exact_steps_come_from_the_profile_or_the_options(tiny_slm_bundle, tmp_path,
                                                                                monkeypatch):
    import edgeroute.runtime as runtime

    engines = []  # the EngineOptions the CLI built
    monkeypatch.setattr(runtime, "Engine", lambda bundle, options, verify=True: engines.append(options)
                        or runtime.engine.Engine(bundle, options))
    device = tmp_path / "device.json"
    device.write_text(json.dumps({"extends": "cpu", "attention": "ort"}))
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps({"extends": "cpu", "kv_dtype": "float16"}))
    for args, attention, exact, kv_dtype in (
            (["--profile", str(device)], "ort", False, "auto"),
            (["--profile", str(device), "--attention", "portable", "--exact-steps"], "portable", True, "auto"),
            (["--profile", str(narrow)], "auto", False, "float16"),
            (["--kv-dtype", "float16"], "auto", False, "float16")):
        result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "a b a b", "--raw", "--max-new-tokens", "4",
                                     *args])
        assert result.exit_code == 0, result.output
        assert (engines[-1].attention, engines[-1].exact_steps, engines[-1].kv_dtype) == (attention, exact, kv_dtype)
        kept = "float32" if kv_dtype == "auto" else kv_dtype  # auto on ONNX Runtime (the tiny bundle has no native weights)
        assert f"{kept} KV cache" in result.output


def test_run_rejects_bad_options_with_a_clear_error(tiny_slm_bundle):
    for args, message in ((["--mode", "turbo"], "mode 'turbo'"), (["--skip-ratio", "1.5", "--mode", "skip"], "skip_ratio"),
                          (["--profile", "nosuch"], "profile 'nosuch' not found"),
                          (["--kv-dtype", "int4"], "KV dtype 'int4' is not one of auto, float32, float16, int8")):
        result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", "hi", *args])
        assert result.exit_code == 2, result.output
        assert "error:" in result.output and message in " ".join(result.output.split())
        assert "Traceback" not in result.output


def test_run_chat_keeps_the_system_prompt_and_drops_old_turns_when_asked(tiny_slm_bundle, tiny_engine):
    turns = "\n".join(["Where is charging station number 7?"] * 8) + "\n/exit\n"
    args = ["run", str(tiny_slm_bundle), "--chat", "--system", "Answer briefly.", "--max-new-tokens", "24"]
    dropped = runner.invoke(app, [*args, "--context-policy", "drop_oldest"], input=turns)
    assert dropped.exit_code == 0, dropped.output
    assert dropped.output.count("tokens,") == 8  # one summary per answered turn
    refused = runner.invoke(app, args, input=turns)
    assert refused.exit_code == 2 and "drop_oldest" in " ".join(refused.output.split())
    chat = tiny_engine.chat(system="Answer briefly.")
    assert chat.generate("Where is charging station number 7?", max_new_tokens=24).text in dropped.output


@pytest.mark.filterwarnings("ignore:Specified provider")  # the Jetson profile's GPU providers, absent here
def test_engine_with_a_profile_and_task_runs_exactly_like_run_with_the_same_flags(tiny_slm_bundle, monkeypatch):
    import edgeroute.runtime as runtime

    built = []
    monkeypatch.setattr(runtime, "Engine", lambda bundle, options, verify=True:
                        built.append(options) or Engine(bundle, options, verify=verify))
    prompt = "Navigate to 221B Baker Street"
    result = runner.invoke(app, ["run", str(tiny_slm_bundle), "--prompt", prompt, "--max-new-tokens", "12",
                                 "--profile", "jetson-orin-nano-8gb,voice-command"])
    assert result.exit_code == 0, result.output
    engine = Engine(tiny_slm_bundle, profile="jetson-orin-nano-8gb", task="voice-command",
                    decoding={"max_new_tokens": 12})
    assert built[0] == engine.settings  # the same options, field for field
    assert engine.settings.memory_budget and engine.settings.providers[0][0] == "TensorrtExecutionProvider"
    assert (engine.options.mode, engine.options.light, engine.options.task) == ("speculate", "ngram", "voice-command")
    assert engine.context_length == min(2048, int(engine.bundle.generation["context_length"]))
    answer = engine.chat().generate(prompt)
    assert answer.tokens and f"{answer.text}\n" in result.output
    assert f"{len(answer.tokens)} tokens" in result.output and "mode speculate" in " ".join(result.output.split())


def test_engine_options_and_profile_keywords_are_not_mixed(tiny_slm_bundle):
    with pytest.raises(InputError, match="either options=EngineOptions"):
        Engine(tiny_slm_bundle, EngineOptions(), profile="cpu")
    with pytest.raises(InputError, match="unknown engine option"):
        Engine(tiny_slm_bundle, kv_cache="int8")


def test_the_stats_line_names_the_native_kernel_set(tiny_slm_bundle):
    from types import SimpleNamespace

    from edgeroute.cli import _runs_on

    assert _runs_on(SimpleNamespace(flavour="native", kernels="dotprod")) == "native dotprod kernels"
    onnx = Engine(tiny_slm_bundle, backend="onnxruntime").llm  # every backend's model says its kernels: None here
    assert onnx.kernels is None and _runs_on(onnx) == onnx.flavour == "portable"


# what `run` does not expose as a flag, and why: set from the Python API or a profile instead
API_ONLY = {
    "task": "a task profile: --profile TASK", "max_draft_tokens": "fitted by calibrate", "adaptive_draft": "API only",
    "skip": "its fields are flags", "fallback": "its thresholds are calibrated",
    "protected_first": "a profile's", "protected_last": "a profile's", "scorer": "a profile's",
    "providers": "onnxruntime-cuda picks them", "activations": "API only", "default_context": "a profile's",
    "default_threads": "a profile's", "memory_budget": "a profile's", "decoding": "its fields are flags",
    "profiles": "--profile", "slm": "--no-slm", "response_format": "--json-schema / --regex / --grammar",
    "protect_format": "a task profile's", "protected_tokens": "derived from the bundle's tokenizer",
}
# flags that fill no option field: what to say and how, not how to decode
CLI_ONLY = {"bundle", "prompt", "chat", "raw", "system", "context_policy", "profile", "no_slm", "json_schema", "regex",
            "grammar", "trace", "tools", "tool_choice", "no_verify", "memory", "no_memory"}


def test_every_option_field_is_a_run_flag_or_named_api_only_and_every_flag_fills_one():
    """`run`'s flags are typed beside the option dataclasses they fill: a field added to one
    without the other is a flag nobody can set, or a flag that sets nothing."""
    import dataclasses
    import inspect

    from edgeroute.cli import run
    from edgeroute.runtime.decoding import DecodeOptions
    from edgeroute.runtime.options import EngineOptions
    from edgeroute.runtime.policies import FallbackOptions
    from edgeroute.skip_options import SkipOptions

    fields = {f.name for cls in (DecodeOptions, EngineOptions, SkipOptions, FallbackOptions)
              for f in dataclasses.fields(cls)}
    fields -= {f.name for f in dataclasses.fields(FallbackOptions)}  # one switch: the fallback is calibrated
    flags = set(inspect.signature(run).parameters)
    assert sorted(fields - flags - set(API_ONLY)) == [], "option fields without a run flag (add one, or to API_ONLY)"
    assert sorted(flags - fields - CLI_ONLY) == [], "run flags that fill no option field"
    assert not set(API_ONLY) & flags, "named API-only but a flag exists"


def test_run_chat_answers_a_tool_result_under_auto_where_your_turns_force_a_call(tiny_models, tmp_path, monkeypatch):
    """--tool-choice NAME (or required) forces a call on your turns; after a /result it would force
    another call, and the model never say the outcome."""
    from edgeroute.runtime.engine import Session

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {
        "name": "navigate", "parameters": {"type": "object", "properties": {"to": {"enum": ["home", "work"]}},
                                           "required": ["to"], "additionalProperties": False}}}]))
    choices, stream = [], Session.stream

    def recorded(self, prompt, **options):
        choices.append(options.get("tool_choice"))
        return stream(self, prompt, **options)

    monkeypatch.setattr(Session, "stream", recorded)
    bundle = tmp_path / "bundle"
    export_tiny(tiny_models["llama"][0], bundle, context_length=640)  # room for the tools
    result = runner.invoke(app, ["run", str(bundle), "--chat", "--tools", str(tools), "--tool-choice",
                                 "navigate", "--max-new-tokens", "60"], input="Take me home\n/result call_0 route set\n/exit\n")
    assert result.exit_code == 0, result.output
    assert '"tool_call": {"id": "call_0", "name": "navigate"' in result.output
    assert choices == [{"type": "function", "function": {"name": "navigate"}}, "auto"]


def test_run_help_names_every_router_the_options_take():
    from edgeroute.runtime.decoding import VERIFIED_BASELINE
    from edgeroute.runtime.policies import ROUTERS

    shown = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    router_help = next(line for line in shown.output.splitlines() if line.strip().startswith("--router"))
    assert set(router_help.split()[-1].split("|")) == {*ROUTERS, VERIFIED_BASELINE}
