"""Structured output: a JSON schema, a regex or a grammar (Lark or GBNF) that every generated
token must fit, enforced with llguidance (torch-free) against the bundle's own tokenizer.

- :class:`ResponseFormat`: what the caller asks for (OpenAI-style ``response_format`` dicts).
- :class:`GrammarCompiler`: the bundle's tokenizer in llguidance's form, built once per engine
  (0.4 s for SmolLM2's 49,152 tokens, ~0.9 s for Qwen's 151,936); compiles a format into a
  :class:`Constraint` once per request.
- :class:`Constraint`: one generation's parser state. It masks the logits of every model that
  picks a token (LLM, SLM), cuts light-path drafts at the first token it rejects, and names the
  *forced* tokens: where the grammar allows a single continuation (a key, a quote, a brace, the
  rest of an enum value), the token needs no model step at all.

Forced tokens are llguidance's fast-forward tokens: the canonical tokenization of the bytes the
grammar forces. llguidance's mask at such a state allows exactly that token, so appending it
without a model step gives the tokens a masked run of every step would pick (pinned by a test).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgeroute.errors import InputError
from edgeroute.runtime.drafters import Proposal, draft_source

FORMAT_TYPES = ("json_schema", "json_object", "regex", "grammar", "text")
# Minified JSON, as models write it when asked for JSON on one line (Qwen2.5 does unprompted):
# the fewest tokens, and with no optional whitespace every separator and key is forced (an
# optional blank would make the next token a choice). A schema's "x-guidance" overrides these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# How a JSON answer may be laid out: "compact" forces the minified layout above (most tokens
# forced, the fastest); "model" lets the model write the layout it would write unconstrained
# (any whitespace, optionally inside a ```json fence): a model that pretty-prints in a fence,
# as Qwen2.5 does when asked for JSON in a sentence, otherwise has its meaning bent to fit a
# layout it does not write (seen on the pair: {"intent": ["navigate"], ...}).
JSON_LAYOUTS = ("compact", "model")


@dataclass(frozen=True)
class ResponseFormat:
    kind: str  # json_schema | regex | grammar
    text: str  # the schema (JSON text), the regex, or the grammar (Lark or GBNF)
    layout: str = "compact"  # json_schema: one of JSON_LAYOUTS

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, layout: str = "compact") -> ResponseFormat:
        if layout not in JSON_LAYOUTS:
            raise InputError(f"response_format layout {layout!r} is not one of {', '.join(JSON_LAYOUTS)}: compact "
                             "(minified, fastest) or model (the model's own whitespace, a ```json fence allowed)")
        schema = _object_schema(schema)
        try:
            text = schema if isinstance(schema, str) else json.dumps(schema)
        except (TypeError, ValueError) as err:  # a set, a class, NaN's cycle...: json's words name no field
            raise InputError(f"response_format: the JSON schema is not JSON ({err}): give it as dicts, lists, "
                             "strings, numbers, booleans and None") from None
        return cls("json_schema", text, layout)

    @classmethod
    def parse(cls, spec: ResponseFormat | dict[str, Any] | None) -> ResponseFormat | None:
        """A format from ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` (OpenAI's
        form; ``{"type": "json_schema", "schema": {...}}`` too), ``{"type": "json_object"}`` (any
        JSON object), ``{"type": "regex", "regex": "..."}``, ``{"type": "grammar", "grammar":
        "..."}`` (Lark or GBNF) or ``{"type": "text"}`` / None (no constraint). A JSON format may
        add ``"layout": "model"`` (see :data:`JSON_LAYOUTS`). The schema ``true`` is any JSON
        value; ``false`` is refused (no answer fits it)."""
        if spec is None or isinstance(spec, ResponseFormat):
            return spec
        if not isinstance(spec, dict) or spec.get("type") not in FORMAT_TYPES:
            got = spec.get("type") if isinstance(spec, dict) else spec
            raise InputError(f"response_format type {got!r} is not one of {', '.join(FORMAT_TYPES)}: "
                             'give e.g. {"type": "json_schema", "json_schema": {"schema": {...}}}')
        kind = spec["type"]
        if kind == "text":
            return None
        if kind in ("json_schema", "json_object"):
            nested = spec.get("json_schema")
            schema = nested.get("schema") if isinstance(nested, dict) else None
            schema = schema if schema is not None else spec.get("schema")
            if schema is None and kind == "json_object":
                schema = {"type": "object"}
            if not isinstance(schema, (dict, bool)):
                raise InputError('response_format json_schema needs a schema object: {"type": "json_schema", '
                                 f'"json_schema": {{"schema": {{...}}}}}} (got {schema!r})')
            return cls.json_schema(schema, spec.get("layout", "compact"))
        text = spec.get(kind)
        if not isinstance(text, str) or not text.strip():
            raise InputError(f'response_format {kind} needs its text: {{"type": "{kind}", "{kind}": "..."}} '
                             f"(got {text!r})")
        return cls(kind, text)

    def describe(self) -> str:
        return {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}[self.kind]


def _object_schema(schema: dict[str, Any] | bool | str) -> dict[str, Any] | str:
    """A boolean schema (or its JSON text) as what it means: true, any JSON value, as the empty
    object schema (llguidance applies its layout options to object schemas only: true failed with
    "Expecting object schema to apply options"); false, which no answer satisfies, refused."""
    value = schema.strip() if isinstance(schema, str) else schema
    if value is False or value == "false":
        raise InputError("response_format: the JSON schema false allows no value at all, so no answer can fit it: "
                         'give a schema an answer can satisfy (true or {} for any JSON value, {"type": "object"} ...)')
    return {} if value is True or value == "true" else schema


def model_layout_grammar(schema_text: str) -> str:
    """A Lark grammar for JSON valid against the schema in the model's own layout: flexible
    whitespace, bare or in one ```json fence (the schema's own "x-guidance" settings win)."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as err:
        raise InputError(f"response_format: the JSON schema is not JSON ({err})") from None
    if isinstance(schema, dict):
        options = schema.get("x-guidance", {})
        if not isinstance(options, dict):
            raise InputError(f'response_format: the schema\'s "x-guidance" must be an object of options (got {options!r})')
        schema = {**schema, "x-guidance": {"whitespace_flexible": True, **options}}
    return ('start: fenced | body\nfenced: "```json\\n" body "\\n```"\n'
            f"body: %json {json.dumps(schema)}\n")


def json_schema_error(schema: Any) -> str | None:
    """What llguidance finds wrong with a JSON schema, or None where it compiles. Needs no
    tokenizer, so a tool's parameters are checked when the tools are given (at the first
    generate, the tools' grammar failed as a whole, naming no tool)."""
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (TypeError, ValueError) as err:  # not JSON (a set, NaN's cycle...), or not a schema at all
        return str(err)
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(m.strip() for m in messages) if failed else None


def _llguidance():
    try:
        import llguidance
    except ImportError as err:
        raise InputError("structured output (response_format, tool calls) needs the llguidance package: "
                         "pip install llguidance") from err
    return llguidance


class GrammarCompiler:
    """Compiles response formats against one tokenizer (built on first use, then shared: it is
    read-only, so sessions in several threads may compile at once)."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_ids: list[int]) -> None:
        self.tokenizer_file, self.vocab_size, self.eos_ids = str(tokenizer_file), vocab_size, list(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                if not self.eos_ids:
                    raise InputError("structured output (response_format, tool calls) needs an end-of-sequence token, "
                                     "and this bundle's tokenizer names none: re-export with a tokenizer that has one")
                llg = _llguidance()
                self._tokenizer = llg.LLTokenizer(self.tokenizer_file, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._tokenizer

    def compile(self, spec: ResponseFormat | dict[str, Any] | None, what: str = "response_format") -> Constraint | None:
        """``spec``'s constraint (None: none); ``what`` names it in errors (the tools' grammar is one too)."""
        fmt = ResponseFormat.parse(spec)
        if fmt is None:
            return None
        llg = _llguidance()
        try:
            if fmt.kind == "json_schema" and fmt.layout == "model":
                grammar = llg.grammar_from("lark", model_layout_grammar(fmt.text))
            elif fmt.kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(fmt.text, defaults=JSON_DEFAULTS)
            elif fmt.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(fmt.text)
            else:
                grammar = llg.grammar_from("grammar", fmt.text)  # Lark, or GBNF converted to Lark
        except ValueError as err:
            raise InputError(f"{what}: the {fmt.describe()} cannot be read: {err}") from None
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InputError(f"{what}: the {fmt.describe()} does not compile: {matcher.get_error().strip()}")
        return Constraint(matcher, self.vocab_size, self.eos_ids[0])


@dataclass
class Draft:
    """Tokens proposed ahead of the LLM, where each came from, the light path's distribution
    each was taken from (masked by the grammar; None for a lookup's or a forced token), and the
    grammar's allowed tokens at every position from the first draft token to the one after the
    last (None where nothing constrains)."""

    tokens: list[int]
    sources: list[str]
    masks: list[np.ndarray | None]
    probabilities: list[np.ndarray | None] = field(default_factory=list)

    @classmethod
    def unconstrained(cls, proposal: Proposal, source: str) -> Draft:
        tokens = proposal.tokens
        return cls(tokens, [source] * len(tokens), [None] * (len(tokens) + 1),
                   list(proposal.probabilities[:len(tokens)]))


def apply_mask(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """The logits with every token the grammar forbids at -inf (unchanged without a mask)."""
    return logits if allowed is None else np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)


class Constraint:
    """The parser state of one generation: always at the tokens generated so far (``advance``
    after each; drafting looks ahead and rolls back)."""

    def __init__(self, matcher, vocab_size: int, eos_id: int) -> None:
        self._matcher, self.vocab_size, self.eos_id = matcher, vocab_size, eos_id
        self._allowed: np.ndarray | None = None  # the current state's mask, computed once
        self.seconds = 0.0  # wall time spent in the parser: masks, forced tokens, advancing

    def _timed(self, call, *args):
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.seconds += time.perf_counter() - start

    @property
    def complete(self) -> bool:
        """The text so far is a whole sentence of the grammar."""
        return self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing may follow but the end-of-sequence token: the structure is whole."""
        return self._matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """Boolean mask over the vocabulary: the tokens the grammar allows next."""
        if self._allowed is None:
            bits = np.frombuffer(self._timed(self._matcher.compute_bitmask), np.uint8)
            self._allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].view(bool)
        return self._allowed

    def forced(self) -> int | None:
        """The next token if the grammar forces it (the first of llguidance's fast-forward
        tokens, recomputed after each so that it is always the one the mask allows), or the
        end-of-sequence token once the structure is complete and nothing may follow."""
        if self.finished:
            return self.eos_id
        tokens = self._timed(self._matcher.compute_ff_tokens)
        return tokens[0] if tokens else None

    def advance(self, token: int) -> None:
        self._allowed = None
        if not self._timed(self._matcher.consume_token, token):
            raise RuntimeError(f"the grammar rejected token {token} that it was asked to allow: "
                               f"{self._matcher.get_error()}")

    def rollback(self, count: int) -> None:
        if count:
            self._allowed = None
            self._timed(self._matcher.rollback, count)

    def constrain(self, proposal: Proposal) -> Proposal:
        """A light path's next token under the grammar: the SLM's most likely allowed token
        (its probabilities renormalised over the allowed ones), the n-gram token if the grammar
        allows it, else nothing (the caller asks the LLM)."""
        if not proposal.tokens:
            return proposal
        # what a router reads besides the token (the SLM's hidden state, the n-gram match, the
        # position in the answer) describes the light path's state, which the mask leaves as it is
        allowed, p = self.allowed(), proposal.probabilities[0]
        if p is None:
            keep = 1 if allowed[proposal.tokens[0]] else 0
            return replace(proposal, tokens=proposal.tokens[:keep], probabilities=proposal.probabilities[:keep],
                           hidden=proposal.hidden[:keep])
        masked = np.where(allowed, p, 0.0)
        total = masked.sum()
        if total <= 0.0:  # the SLM gives every allowed token zero probability (underflow)
            return replace(proposal, tokens=[], probabilities=[], hidden=[])
        masked /= total
        return replace(proposal, tokens=[int(np.argmax(masked))], probabilities=[masked], hidden=proposal.hidden[:1])

    def draft(self, light, tokens: list[int], light_tokens: int, limit: int) -> Draft:
        """Up to ``light_tokens`` light-path tokens, each checked by the grammar, with the
        tokens it forces in between, ``limit`` tokens in all; it ends at the first light
        token the grammar rejects. The state is rolled back afterwards."""
        draft = Draft([], [], [])
        sequence = list(tokens)
        try:
            while True:
                draft.masks.append(self.allowed())
                if len(draft.tokens) >= limit:
                    break
                forced = self.forced()
                if forced == self.eos_id:  # the LLM's own token after the draft is the end (the mask allows only it)
                    break
                if forced is not None:
                    token, origin, p = forced, "grammar", None
                else:
                    proposal = self.constrain(light.propose(sequence, 1)) if light_tokens > 0 else Proposal([], [])
                    if not proposal.tokens:
                        break
                    token, origin, p = proposal.tokens[0], draft_source(proposal, light), proposal.probabilities[0]
                    light_tokens -= 1
                self.advance(token)
                sequence.append(token)
                draft.tokens.append(token)
                draft.sources.append(origin)
                draft.probabilities.append(p)
        finally:
            self.rollback(len(draft.tokens))
        return draft
