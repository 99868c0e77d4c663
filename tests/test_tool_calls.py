"""Tool calls (OpenAI function calling): every call the model makes parses and validates against
its tool's parameters in every mode, tool_choice means what it says, results go back into the
chat as the template would render them, streams carry the content only, and bad tools, choices
and results are refused with the fix."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
from tokenizers import AddedToken, Tokenizer

from edgeroute.chat_format import FALLBACK_TOOL_FORMAT, ToolFormat, format_messages
from edgeroute.errors import InputError
from edgeroute.export.chat import derive_chat_format, derive_tool_format, render
from edgeroute.runtime.tools import (
    CallNames,
    ContentFilter,
    parse_tool_choice,
    parse_tools,
    split_tool_calls,
    tool_grammar,
)
from tests.conftest import export_tiny

TOOLS = [
    {"type": "function", "function": {
        "name": "navigate", "description": "Start navigation to a destination.",
        "parameters": {"type": "object", "properties": {"destination": {"type": "string", "maxLength": 12}},
                       "required": ["destination"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_temperature", "description": "Set the cabin temperature.",
        "parameters": {"type": "object", "properties": {
            "celsius": {"type": "integer", "minimum": 16, "maximum": 28},
            "zone": {"type": "string", "enum": ["driver", "passenger", "all"]}},
            "required": ["celsius", "zone"], "additionalProperties": False}}},
]
SYSTEM = "You are the voice assistant of a car. Use the tools to act."
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# a Hermes-style template with tools, in the shape of Qwen2.5's (system with a <tools> list,
# calls in <tool_call> blocks, results as <tool_response> blocks in a user turn)
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}

# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call one as <tool_call>
{"name": ..., "arguments": ...}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% else %}<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}{% if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for call in message.tool_calls %}{% set call = call.function %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}{{ '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _valid(call) -> None:
    assert call.name in SCHEMAS, call
    jsonschema.validate(call.arguments, SCHEMAS[call.name])


# -- the format, taken apart at export ---------------------------------------------------------------

def test_a_template_with_tools_is_taken_apart_into_pieces_that_reproduce_it():
    chat_format = derive_chat_format(HERMES_TEMPLATE)
    tools = ToolFormat.from_dict(chat_format["tools"])
    assert tools.native and tools.call_open == "<tool_call>\n" and tools.response_open == "<tool_response>\n"
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Warmer please"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"function": {"name": "set_temperature", "arguments": {"celsius": 23, "zone": "all"}}}]},
                    {"role": "tool", "content": '{"ok": true}'}]
    assert format_messages(chat_format, conversation, TOOLS) == render(HERMES_TEMPLATE, conversation, True, TOOLS)
    # OpenAI messages carry the arguments as JSON text: rendered as the object they hold
    conversation[2]["tool_calls"][0]["function"]["arguments"] = '{"celsius": 23, "zone": "all"}'
    assert format_messages(chat_format, conversation, TOOLS) == render(HERMES_TEMPLATE, conversation[:2], False, TOOLS) + \
        render(HERMES_TEMPLATE, conversation, True, TOOLS).split(render(HERMES_TEMPLATE, conversation[:2], False, TOOLS))[1] \
        .replace('"{\\"celsius\\": 23, \\"zone\\": \\"all\\"}"', '{"celsius": 23, "zone": "all"}')


def test_a_template_without_tools_gets_none_and_the_runtime_uses_the_fallback():
    template = HERMES_TEMPLATE.replace("{%- if tools %}", "{%- if false %}")
    chat_format = derive_chat_format(template)
    assert chat_format is not None and "tools" not in chat_format
    assert derive_tool_format(template, chat_format) is None
    text = format_messages(chat_format, [{"role": "user", "content": "Hi"}], TOOLS)
    assert '"name": "navigate"' in text and text.count("<tools>") == 2  # the fallback lists them in the system turn


def test_pieces_that_do_not_reproduce_the_template_are_refused():
    # a template that sorts the call's keys: the runtime's calls would not match what the model saw
    template = HERMES_TEMPLATE.replace("(call.arguments | tojson)", "(call.arguments | tojson(sort_keys=true))")
    chat_format = derive_chat_format(template)
    assert derive_tool_format(template, {k: v for k, v in chat_format.items() if k != "tools"}) is None


# -- grammar, split and stream filter, without a model -------------------------------------------------

def grammar_matcher(path, special):
    """Whether a text fits the tools' grammar under a choice, on the tokenizer at ``path``
    (``special``: the id of a markup string that is one special token, else None)."""
    tokenizer = Tokenizer.from_file(str(path))
    compiled = llguidance.LLTokenizer(str(path), n_vocab=tokenizer.get_vocab_size(), eos_token=[0])

    def fits(choice: str, text: str, tools=TOOLS) -> bool:
        grammar = tool_grammar(parse_tools(tools), choice, FALLBACK_TOOL_FORMAT, special or (lambda _: None))
        matcher = llguidance.LLMatcher(compiled, llguidance.grammar_from("lark", grammar), log_level=0)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text).ids) and matcher.is_accepting()
    return fits


@pytest.fixture(scope="module")
def smollm2_matcher(smollm2_tokenizer_dir):
    return grammar_matcher(smollm2_tokenizer_dir / "tokenizer.json", None)


GOOD = '<tool_call>\n{"name": "set_temperature", "arguments": {"celsius": 21, "zone": "driver"}}\n</tool_call>'


@pytest.mark.parametrize("wrong", [
    GOOD.replace("set_temperature", "set_temp"),  # no such tool
    GOOD.replace("21", "35"),  # out of range
    GOOD.replace('"driver"', '"rear"'),  # not in the enum
    GOOD.replace(', "zone": "driver"', ""),  # a required argument missing
    GOOD.replace('"driver"}', '"driver", "fan": 3}'),  # an argument the tool does not take
    GOOD.replace("21", '"21"'),  # a string for an integer
])
def test_the_grammar_refuses_calls_that_would_not_validate(smollm2_matcher, wrong):
    assert smollm2_matcher("required", GOOD)
    assert not smollm2_matcher("required", wrong)
    assert not smollm2_matcher("auto", "Sure.\n" + wrong)


def test_tool_choice_shapes_what_the_grammar_takes(smollm2_matcher):
    text, two = "Turning it up.", GOOD + "\n" + GOOD.replace("21", "22")
    assert smollm2_matcher("auto", text) and smollm2_matcher("auto", text + "\n" + GOOD)
    assert smollm2_matcher("none", text) and not smollm2_matcher("none", GOOD)
    assert not smollm2_matcher("required", text) and smollm2_matcher("required", two)
    assert smollm2_matcher("set_temperature", GOOD) and not smollm2_matcher("set_temperature", two)
    assert not smollm2_matcher("navigate", GOOD)



def test_a_tool_whose_parameters_refer_to_their_own_defs_is_taken_and_its_calls_follow_them(smollm2_matcher):
    # pydantic's model_json_schema() writes nested models as "$defs" and "#/$defs/..." references
    route = [{"type": "function", "function": {"name": "route", "parameters": {
        "type": "object", "properties": {"stop": {"$ref": "#/$defs/Stop"}}, "required": ["stop"],
        "$defs": {"Stop": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}}}]
    call = '<tool_call>\n{"name": "route", "arguments": {"stop": {"city": "Bonn"}}}\n</tool_call>'
    assert smollm2_matcher("required", call, route)
    assert not smollm2_matcher("required", call.replace('"Bonn"', "7"), route)


@pytest.fixture(scope="module")
def hermes_matcher(smollm2_tokenizer_dir, tmp_path_factory):
    """SmolLM2's tokenizer with <tool_call> and </tool_call> as special tokens (Qwen2.5's kind of
    markup): the grammar under a choice, and whether a text fits it."""
    tokenizer = Tokenizer.from_file(str(smollm2_tokenizer_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<tool_call>", "</tool_call>")])
    path = tmp_path_factory.mktemp("hermes") / "tokenizer.json"
    tokenizer.save(str(path))
    return grammar_matcher(path, tokenizer.token_to_id)


# a call as Qwen2.5-Coder writes one under auto: a Markdown JSON block, pretty-printed
FENCED = '```json\n{\n  "name": "set_temperature",\n  "arguments": {\n    "celsius": 21,\n    "zone": "driver"\n  }\n}\n```'


@pytest.mark.parametrize("wrong", [
    FENCED.replace("set_temperature", "set_temp"),  # no such tool
    FENCED.replace("21", "35"),  # out of range
    FENCED.replace('"driver"', '"rear"'),  # not in the enum
    FENCED.replace(',\n    "zone": "driver"', ""),  # a required argument missing
    FENCED.replace('"arguments"', '"args"'),  # not a call's shape
    FENCED.removesuffix("```"),  # never closed
])
def test_under_auto_a_fenced_call_must_be_a_valid_call_where_the_markup_is_special(hermes_matcher, wrong):
    assert hermes_matcher("auto", FENCED) and hermes_matcher("auto", "On it.\n" + FENCED + "\nDone.")
    assert hermes_matcher("auto", FENCED.replace("```json", "```"))  # untagged fences too
    assert hermes_matcher("auto", GOOD) and hermes_matcher("auto", "Sure.")
    assert not hermes_matcher("auto", wrong)
    # other fenced blocks stay free text; the other choices take no fenced call
    assert hermes_matcher("auto", 'Like this:\n```json\n{"city": "Bonn"}\n```\n```python\nprint(1)\n```')
    assert not hermes_matcher("required", FENCED) and hermes_matcher("required", GOOD)
    assert hermes_matcher("none", "Sure.") and not hermes_matcher("none", GOOD)


def test_fenced_calls_split_stream_and_tell_their_names_where_they_are_allowed():
    ids = iter(range(10))
    text = "On it.\n" + FENCED + "\n" + GOOD.replace("21", "22")
    content, calls = split_tool_calls(text, FALLBACK_TOOL_FORMAT, lambda: f"call_{next(ids)}", fenced=True)
    assert content == "On it." and [(c.name, c.arguments["celsius"]) for c in calls] == [("set_temperature", 21),
                                                                                       ("set_temperature", 22)]
    assert split_tool_calls(text, FALLBACK_TOOL_FORMAT, lambda: "x")[1][0].arguments["celsius"] == 22  # not fenced
    cut = split_tool_calls("On it.\n" + FENCED[:40], FALLBACK_TOOL_FORMAT, lambda: "x", fenced=True)
    assert cut == ("On it.", [])  # a call the budget cut short is dropped and ends the content
    shown = ContentFilter(FALLBACK_TOOL_FORMAT, 7, fenced=True)
    pieces = ["Use `ls`", " or ``", "`python\nprint(1)\n``", "`\nNow:\n``", "`json\n{\n", '  "na', 'me": "set']
    assert "".join(shown.push(0, p) for p in pieces) + shown.flush() == "Use `ls` or ```python\nprint(1)\n```\nNow:"
    names = CallNames(FALLBACK_TOOL_FORMAT, 7, 8, fenced=True)
    told = [names.push(0, FENCED[i:i + 4]) for i in range(0, len(FENCED), 4)]
    assert [t for t in told if t] == ["set_temperature"]
    assert told.index("set_temperature") * 4 < FENCED.index('"arguments"')


def test_an_answer_splits_into_its_content_and_typed_calls():
    ids = iter(range(10))
    content, calls = split_tool_calls("On it.\n" + GOOD + "\n" + GOOD.replace("21", "22"), FALLBACK_TOOL_FORMAT,
                                      lambda: f"call_{next(ids)}")
    assert content == "On it."
    assert [(c.id, c.name, c.arguments["celsius"]) for c in calls] == [("call_0", "set_temperature", 21),
                                                                       ("call_1", "set_temperature", 22)]
    assert json.loads(calls[0].to_message()["function"]["arguments"]) == {"celsius": 21, "zone": "driver"}
    assert split_tool_calls("No call here.", FALLBACK_TOOL_FORMAT, lambda: "x") == ("No call here.", [])


def test_a_stream_shows_text_until_a_call_opens_and_holds_back_what_may_open_one():
    shown = ContentFilter(FALLBACK_TOOL_FORMAT, None)
    pieces = [shown.push(0, t) for t in ["On it", ". <to", "day> ok", "\n<tool", "_call>\n{", '"name"']]
    assert "".join(pieces) + shown.flush() == "On it. <today> ok"
    special = ContentFilter(FALLBACK_TOOL_FORMAT, 7)
    assert special.push(1, "Sure.") == "Sure." and special.push(7, "") == "" and special.push(2, "{") == ""



def test_each_call_name_is_told_once_as_soon_as_its_closing_quote_is_decoded():
    text = "On it. " + GOOD + "\n" + GOOD.replace("set_temperature", "navigate")
    names, told = CallNames(FALLBACK_TOOL_FORMAT, None, None), []
    for i in range(0, len(text), 3):  # three characters a token, markup and the name split across tokens
        name = names.push(0, text[i:i + 3])
        told.append((name, text[:i + 3]) if name else None)
    told = [t for t in told if t]
    assert [name for name, _ in told] == ["set_temperature", "navigate"]
    for name, so_far in told:  # told by the token that closed the name, before any argument
        assert so_far.rsplit('"name": ', 1)[1].startswith(f'"{name}"') and '"' in so_far[-3:]
        assert so_far.count('"arguments"') == (0 if name == "set_temperature" else 1)
    special = CallNames(FALLBACK_TOOL_FORMAT, 7, 8)  # markup as special tokens
    said = [special.push(t, x) for t, x in [(1, "Sure."), (7, ""), (2, '\n{"name": "nav'), (3, 'igate", "a'),
                                              (4, 'rguments": {}}\n'), (8, ""), (7, ""), (5, '{"name": "call"')]]
    assert [s for s in said if s] == ["navigate", "call"]
    assert CallNames(FALLBACK_TOOL_FORMAT, None, None).push(0, 'Say {"name": "navigate"} aloud.') is None


# -- on a model ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory, tiny_models):
    """The tiny Llama with its one-layer SLM, exported with room for the tools' prompt."""
    from edgeroute.runtime import Engine

    src = tiny_models["llama"][0]
    out = tmp_path_factory.mktemp("tiny-tools") / "llama"
    export_tiny(src, out, slm=str(src), slm_layers=1, context_length=640)
    return Engine(out)


@pytest.mark.filterwarnings("ignore::edgeroute.errors.UnmeasuredQualityWarning")
@pytest.mark.parametrize("mode", ["full", "speculate", "route", "skip"])
def test_required_calls_parse_and_validate_in_every_mode_and_lossless_ones_equal_full(tool_engine, mode):
    full = tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=60).generate(
        "Set the driver side to 21 degrees.", tool_choice="required")
    skip = {"protected_first": 1, "protected_last": 1} if mode == "skip" else {}
    chat = tool_engine.chat(system=SYSTEM, tools=TOOLS, mode=mode, light="slm", max_new_tokens=60, **skip)
    generation = chat.generate("Set the driver side to 21 degrees.", tool_choice="required")
    if generation.finish_reason == "incomplete":  # a random model may run out of tokens inside a call
        pytest.skip("the budget ended inside a call")
    assert generation.tool_calls and generation.text == ""
    for call in generation.tool_calls:
        _valid(call)
    if mode == "speculate":
        assert generation.tokens == full.tokens and generation.tool_calls == full.tool_calls


def test_a_named_tool_is_called_exactly_once_and_none_calls_nothing(tool_engine):
    chat = tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=60)
    named = chat.generate("Take me home.", tool_choice={"type": "function", "function": {"name": "navigate"}})
    assert [c.name for c in named.tool_calls] == ["navigate"] and named.finish_reason == "tool_calls"
    _valid(named.tool_calls[0])
    quiet = tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=40).generate("Hi", tool_choice="none")
    assert quiet.tool_calls == [] and "<tool_call>" not in quiet.text


def test_tool_choice_none_with_a_response_format_answers_in_the_format_and_others_are_refused(tool_engine):
    chat = tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=60)
    called = chat.generate("Take me home.", tool_choice={"type": "function", "function": {"name": "navigate"}})
    results = [{"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": '{"ok": true}'}]
    said = "Navigating to {home} [now] (3.5 km) #1 & more."  # characters a regex reads as syntax
    answer = chat.generate(results, tool_choice="none", response_format={"type": "regex", "regex": re.escape(said)})
    assert answer.text == said and answer.tool_calls == [] and answer.finish_reason == "eos"
    assert answer.stats.llm_calls == 0  # one path through the grammar: every token forced, no model step
    assert chat.messages[-1] == {"role": "assistant", "content": said}
    assert chat.generate("And then?", tool_choice="auto").finish_reason in ("eos", "length", "tool_calls")
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}
    fresh = tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=60)
    assert json.loads(fresh.generate("Answer in JSON.", tool_choice="none", response_format=schema).text).keys() == {"ok"}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "navigate"}}):
        with pytest.raises(InputError, match="give tool_choice='none' with a response_format"):
            fresh.generate("Hi", tool_choice=choice, response_format=schema)


def test_a_named_call_that_ends_at_the_token_budget_is_whole_and_one_cut_short_is_no_call(tool_engine):
    named, prompt = {"type": "function", "function": {"name": "navigate"}}, "Take me home."

    def answer(budget: int):
        return tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=budget).generate(prompt, tool_choice=named)
    whole = answer(60)
    # the call's close ends the answer: the grammar forces the end-of-turn token, no model step
    assert whole.finish_reason == "tool_calls" and whole.trace[-1].source == "grammar"
    assert whole.tokens[-1] in tool_engine.eos_ids
    at_close = answer(len(whole.tokens) - 1)  # the budget leaves the forced end-of-turn token out
    assert at_close.finish_reason == "tool_calls" and at_close.tool_calls == whole.tool_calls
    cut = answer(len(whole.tokens) - 2)  # the close itself cut: no call, the answer incomplete
    assert cut.finish_reason == "incomplete" and cut.tool_calls == []


def test_an_auto_stream_carries_the_content_only_and_the_calls_come_with_the_generation(tool_engine):
    chat = tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=80)
    pieces = list(chat.stream("Set the driver side to 21 degrees."))
    generation = chat.last
    assert "".join(pieces) == generation.text and "<tool_call>" not in generation.text
    raw = tool_engine.tokenizer.decode(generation.tokens, skip_special_tokens=False)
    assert len(generation.tool_calls) == raw.count("</tool_call>")
    for call in generation.tool_calls:
        _valid(call)


def test_a_stream_tells_each_call_name_before_the_call_is_complete(tool_engine):
    chat = tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=80)
    decoded, told = [], []
    chat.generate("Set the driver side to 21 degrees.", tool_choice="required", on_token=lambda t: decoded.append(t),
                  on_tool_name=lambda name: told.append((name, len(decoded))))
    generation = chat.last
    if generation.finish_reason == "incomplete":
        pytest.skip("the budget ended inside a call")
    assert [name for name, _ in told] == [c.name for c in generation.tool_calls]
    for name, at in told:  # told while the call's arguments were still to come
        assert at < len(generation.tokens)
        raw = tool_engine.tokenizer.decode(generation.tokens[:at], skip_special_tokens=False)
        assert raw.rstrip(", ").endswith(f'"{name}"') and '"arguments"' not in raw.rsplit("<tool_call>", 1)[-1]


def test_tool_results_continue_the_chat_as_a_cold_prefill_of_the_whole_conversation_would(tool_engine):
    chat = tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=60)
    called = chat.generate("Take me to the airport.", tool_choice={"type": "function", "function": {"name": "navigate"}})
    results = [{"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": '{"eta_min": 25}'}]
    answer = chat.generate(results, tool_choice="none", max_new_tokens=12)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert chat.messages[2]["tool_calls"][0]["function"]["name"] == "navigate"
    # the sequence holds the text the template renders for the conversation so far
    held = tool_engine.tokenizer.decode(chat.state.tokens[:chat._answer_start], skip_special_tokens=False)
    assert held == format_messages(tool_engine.chat_format, chat.messages[:4], TOOLS)
    assert answer.tool_calls == [] and chat.messages[4]["content"] == answer.text


def test_bad_tools_choices_and_results_are_refused_with_the_fix(tool_engine):
    with pytest.raises(InputError, match="list of"):
        tool_engine.chat(tools={"type": "function"})
    with pytest.raises(InputError, match="name"):
        tool_engine.chat(tools=[{"type": "function", "function": {"name": "turn left"}}])
    with pytest.raises(InputError, match="reserves"):
        tool_engine.chat(tools=[{"type": "function", "function": {"name": "none"}}])
    with pytest.raises(InputError, match="differ"):
        tool_engine.chat(tools=TOOLS + TOOLS[:1])
    with pytest.raises(InputError, match="object"):
        tool_engine.chat(tools=[{"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}])
    chat = tool_engine.chat(system=SYSTEM, tools=TOOLS, max_new_tokens=8)
    with pytest.raises(InputError, match="tool_choice"):
        chat.generate("Hi", tool_choice="sometimes")
    with pytest.raises(InputError, match="not one of the tools"):
        chat.generate("Hi", tool_choice={"type": "function", "function": {"name": "honk"}})
    with pytest.raises(InputError, match="stop strings"):
        chat.generate("Hi", stop=["."])
    with pytest.raises(InputError, match="response_format with tool_choice .auto."):
        chat.generate("Hi", response_format={"type": "json_object"})
    with pytest.raises(InputError, match="needs tools"):
        tool_engine.chat(max_new_tokens=8).generate("Hi", tool_choice="required")
    with pytest.raises(InputError, match="chat messages"):
        tool_engine.session(tools=TOOLS).generate("Hi")
    chat.generate("Hi", tool_choice="none")
    with pytest.raises(InputError, match="called tools"):  # the last answer made no call
        chat.generate([{"role": "tool", "tool_call_id": "call_0", "content": "{}"}])
    chat.generate("Home", tool_choice={"type": "function", "function": {"name": "navigate"}}, max_new_tokens=60)
    with pytest.raises(InputError, match="one of the last answer's calls"):
        chat.generate([{"role": "tool", "tool_call_id": "call_99", "content": "{}"}])


@pytest.mark.parametrize("parameters, problem", [
    ({"type": "object", "properties": {"speed": {"type": "fast"}}}, "Invalid type: fast"),
    ({"type": "object", "properties": {"plate": {"type": "string", "pattern": "(("}}}, "unclosed group"),
    ({"type": "object", "properties": {"stop": {"$ref": "#/$defs/Stop"}}}, "does not exist"),
])
def test_a_tool_whose_parameters_do_not_compile_is_refused_by_name_when_the_tools_are_given(tool_engine, parameters,
                                                                                             problem):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "honk", "parameters": parameters}}]
    for give in (lambda: tool_engine.chat(tools=tools), lambda: tool_engine.session(tools=tools),
                 lambda: tool_engine.generate([{"role": "user", "content": "Hi"}], tools=tools)):
        with pytest.raises(InputError, match=f"(?s)tool honk: its parameters are not a JSON schema that compiles .*{problem}"):
            give()


SHAPE = r'tool call 0 is not \{"id": \.\.\., "type": "function", "function": \{"name": \.\.\., "arguments": '


@pytest.mark.parametrize("calls, message", [
    ([{"function": "navigate"}], SHAPE),  # the name where its object belongs
    (["navigate"], SHAPE),
    ([{"id": "call_0", "type": "function", "function": {"arguments": "{}"}}], SHAPE),
    ("navigate", "tool_calls must be a list of"),
    ([{"function": {"name": "navigate", "arguments": "to=home"}}], r"tool call 0 \(navigate\) has arguments 'to=home'"),
    ([{"function": {"name": "navigate", "arguments": "[1]"}}], r"tool call 0 \(navigate\) has arguments '\[1\]'"),
    ([{"function": {"name": "navigate"}}], r"tool call 0 \(navigate\) has arguments None: give a JSON object"),
])
def test_an_assistant_message_whose_tool_calls_have_another_shape_is_refused_naming_it_and_the_shape(tool_engine, calls,
                                                                                                     message):
    messages = [{"role": "user", "content": "Home"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": "{}"}]
    with pytest.raises(InputError, match="message 1 \\(assistant\\): " + message):
        tool_engine.chat(tools=TOOLS, max_new_tokens=4).generate(messages, tool_choice="none")
    messages[0]["tool_calls"] = messages[1].pop("tool_calls")  # calls in a user message
    with pytest.raises(InputError, match="message 0 \\(user\\) has tool_calls: only an assistant message"):
        tool_engine.chat(tools=TOOLS, max_new_tokens=4).generate(messages, tool_choice="none")


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": "navigate"},  # the name where its object belongs
    {"type": "function", "function": {"name": ["navigate"]}},
    {"type": "function"},
    {"function": {"name": "navigate"}},
])
def test_a_tool_choice_object_of_another_shape_is_an_input_error_showing_the_shape(choice):
    with pytest.raises(InputError, match=r'is not \{"type": "function", "function": \{"name": \.\.\.\}\}'):
        parse_tool_choice(choice, TOOLS)


def test_a_tool_choice_that_is_a_bare_tool_name_is_refused_showing_the_object_that_names_it():
    with pytest.raises(InputError, match=r'to call that tool give \{"type": "function", "function": \{"name": "navigate"\}\}'):
        parse_tool_choice("navigate", TOOLS)
    with pytest.raises(InputError, match=r'not one of auto, required, none or \{"type": "function", "function": '):
        parse_tool_choice("nowhere", TOOLS)


def test_run_with_tools_prints_each_call_as_a_json_line(tool_engine, tmp_path):
    from typer.testing import CliRunner

    from edgeroute.cli import app

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"tools": TOOLS}))
    result = CliRunner().invoke(app, ["run", str(tool_engine.bundle.path), "--prompt", "Warmer please", "--tools",
                                      str(tools), "--tool-choice", "set_temperature", "--max-new-tokens", "60"])
    assert result.exit_code == 0, result.output
    calls = [json.loads(line)["tool_call"] for line in result.stdout.splitlines() if line.startswith('{"tool_call"')]
    assert [c["name"] for c in calls] == ["set_temperature"]
    jsonschema.validate(calls[0]["arguments"], SCHEMAS["set_temperature"])
    missing = CliRunner().invoke(app, ["run", str(tool_engine.bundle.path), "--prompt", "x", "--tool-choice", "none"])
    assert missing.exit_code == 2 and "--tool-choice needs --tools" in " ".join(missing.output.split())
    tools.write_text("[")
    broken = CliRunner().invoke(app, ["run", str(tool_engine.bundle.path), "--prompt", "x", "--tools", str(tools)])
    assert broken.exit_code == 2 and "is not JSON" in " ".join(broken.output.split())
