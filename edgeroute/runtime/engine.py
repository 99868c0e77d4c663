"""The embeddable API: load a bundle once, then generate, stream or chat.

>>> engine = Engine("bundles/smollm2-demo")                     # or profile="cpu", task="json", ...
>>> engine.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=32).text
>>> chat = engine.chat(mode="speculate")          # keeps its KV caches across turns
>>> for piece in chat.stream("Navigate to 12 Baker Street"): print(piece, end="")
>>> chat.generate("And then home?")                # a follow-up user turn: prefills only its own tokens
>>> car = engine.chat(tools=[{"type": "function", "function": {"name": "navigate", "parameters": {...}}}])
>>> car.generate("Take me home").tool_calls        # [ToolCall(id="call_0", name="navigate", arguments={...})]
>>> car.generate([{"role": "tool", "tool_call_id": "call_0", "content": '{"eta_min": 12}'}])  # the result back
>>> engine.close()                                 # models and caches freed now (or: with Engine(...) as engine:)
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from edgeroute.bundle import Bundle, RouterCalibration
from edgeroute.chat_format import ToolFormat, format_messages, tool_format
from edgeroute.cpu import cpu_signature, signature_difference
from edgeroute.errors import (
    BundleError,
    CalibrationDeviceWarning,
    EngineClosed,
    InputError,
    SessionBusy,
    UnmeasuredQualityWarning,
)
from edgeroute.kv_formats import INT8_GROUP, KV_DTYPE_CHOICES, check_kv_dtype, kv_row_bytes
from edgeroute.runtime.aio import ThreadedStream
from edgeroute.runtime.answer_memory import AnswerMemory
from edgeroute.runtime.attention import KVCache
from edgeroute.runtime.backend import ModelBackend, backend_for, close_cache, open_model, resolve_kv_dtype
from edgeroute.runtime.calibrated import calibrated_options, calibrated_route, format_token_ids
from edgeroute.runtime.constraints import Constraint, GrammarCompiler
from edgeroute.runtime.decoding import (
    DecodeOptions,
    Decoder,
    GenerationStats,
    SequenceState,
    TokenTrace,
)
from edgeroute.runtime.drafters import DraftVocabulary, common_ids, draft_lengths
from edgeroute.runtime.memory import check_fit
from edgeroute.runtime.options import EngineOptions
from edgeroute.runtime.routers import TrainedRouter
from edgeroute.runtime.text_stream import IncrementalDetokenizer, StopFilter
from edgeroute.runtime.tools import (
    CallNames,
    ContentFilter,
    ToolCall,
    check_tool_calls,
    fenced_calls,
    parse_tool_choice,
    parse_tools,
    split_tool_calls,
    tool_grammar,
)
from edgeroute.skip_options import SkipOptions

Messages = Sequence[dict[str, Any]]
Tools = Sequence[dict[str, Any]]
ToolChoice = str | dict[str, Any] | None  # "auto" (None) | "required" | "none" | {"type": "function", ...}


ROLES = ("system", "user", "assistant", "tool")


def check_prompt(prompt: Any) -> None:
    """An InputError naming what is wrong unless ``prompt`` is text or a list of OpenAI-style
    messages (objects whose ``content`` is text, or None beside tool calls), all of it valid
    Unicode: the tokenizer's own errors (a TypeError, a lone surrogate) name neither."""
    if isinstance(prompt, str):
        _check_text(prompt, "the prompt")
        return
    if not isinstance(prompt, list | tuple):
        raise InputError(f"a prompt is a string or a list of messages ({{'role': 'user', 'content': ...}}), "
                         f"got {type(prompt).__name__}")
    for index, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise InputError(f"message {index} is a {type(message).__name__}, not a {{'role': ..., 'content': ...}} "
                             "object")
        if message.get("role") not in ROLES:  # the chat format reads it (a KeyError's message is only 'role')
            raise InputError(f"message {index} has role {message.get('role')!r}: one of {', '.join(ROLES)}")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise InputError(f"message {index} ({message['role']}) has no content")
        if content is not None:
            if not isinstance(content, str):
                raise InputError(f"message {index}: content must be text (got {type(content).__name__})")
            _check_text(content, f"message {index}")
        if message.get("tool_calls"):
            if message["role"] != "assistant":
                raise InputError(f"message {index} ({message['role']}) has tool_calls: only an assistant message "
                                 "calls tools")
            check_tool_calls(message["tool_calls"], f"message {index} (assistant)")


def check_system_prompt(system: Any) -> None:
    if not isinstance(system, str):
        raise InputError(f"the system prompt must be text (got {type(system).__name__})")
    _check_text(system, "the system prompt")


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InputError(f"{what} is not valid Unicode text: {err.reason} at character {err.start}") from None


def _said(message: dict[str, Any]) -> bool:
    """A message that carries something: text, or tool calls."""
    return bool((message.get("content") or "").strip() or message.get("tool_calls"))


def open_tokenizer(bundle: Bundle) -> Tokenizer:
    """The bundle's tokenizer; a file the tokenizers library cannot read (damaged, and opened
    with ``verify=False``, which skips its sha256) is a BundleError naming it."""
    path = bundle.file(bundle.tokenizer["file"])
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises plain Exception with its parser's message
        raise BundleError(f"{path} is not a tokenizer this runtime reads ({str(err)[:200]}): the bundle is damaged, "
                          "export again") from err


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    trace: list[TokenTrace] = field(default_factory=list)
    # length | eos | stop | cancelled | incomplete (a response_format's structure is unfinished:
    # the text is not valid output) | tool_calls (the answer ended after calling tools). A grammar
    # that ended where the budget did ends with eos (tool_calls): only its forced end was left out
    finish_reason: str = "length"
    # the tools the answer called (chats with tools); ``text`` is then the content before them
    tool_calls: list[ToolCall] = field(default_factory=list)


class Engine:
    """A loaded bundle: tokenizer and models (ONNX Runtime sessions or native kernels), shared by
    every session. ``close()`` (or the end of a ``with Engine(...) as engine:`` block) frees them."""

    def __init__(self, bundle: str | Path | Bundle, options: EngineOptions | None = None, *,
                 profile: str | Sequence[str] | None = None, task: str | None = None, verify: bool = True,
                 **settings: Any) -> None:
        """``options`` (:class:`EngineOptions`), or ``profile`` (device profiles, names or JSON
        files) and ``task`` (a task profile) merged as ``edgeroute run --profile DEVICE,TASK``
        merges them, with ``settings`` on top: any field of ``EngineOptions`` as a keyword
        (``backend="native"``, ``kv_dtype="float16"``, ``context_length=512``, ...), and
        ``decoding={...}`` for the sessions' default ``DecodeOptions`` fields. What each
        setting does: ``EngineOptions`` and docs/guide/python-api.md."""
        if options is None:
            options = EngineOptions.from_profile(profile, task, **settings)
        elif profile is not None or task is not None or settings:
            raise InputError("give Engine either options=EngineOptions(...) or profile/task/keyword settings, "
                             "not both: EngineOptions.from_profile(profile, task, **settings) merges them")
        self.settings = options
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle, verify=verify)
        # earlier answers for speculation's prompt lookup to draft from: the calibration's (the LLM's
        # answers to its labelled prompts), not learning, so a run never drafts a prompt's own earlier
        # answer; an app sets AnswerMemory() (or AnswerMemory.load(path)) to learn as it answers
        memory_file = self.bundle.calibration.decoding.get("answer_memory") if self.bundle.calibration else None
        self.answer_memory = AnswerMemory.load(self.bundle.path / memory_file, learning=False) if memory_file else None
        exported = int(self.bundle.generation["context_length"])
        self.context_length = options.session_context(exported)
        if (isinstance(self.context_length, bool) or not isinstance(self.context_length, int)
                or not 1 <= self.context_length <= exported):
            raise InputError(f"context_length must be a whole number within 1..{exported} (got {self.context_length!r}): "
                             f"the bundle was exported with --context-length {exported}; export again for a longer one")
        self.use_slm = options.slm and self.bundle.slm is not None
        check_kv_dtype(options.kv_dtype, KV_DTYPE_CHOICES)  # a wrong name fails before anything loads
        if options.decoding.mode != "auto":  # so do the sessions' defaults (auto is resolved per session)
            self._validate(options.decoding)
        if options.memory_budget is not None:
            roles = ["llm", "slm"] if self.use_slm else ["llm"]
            caches = [resolve_kv_dtype(options.kv_dtype, backend_for(self.bundle.models[role], options)[0],
                                       self.bundle.models[role], options.kernels) for role in roles]
            check_fit(self.bundle, self.context_length, options.memory_budget,
                      max(caches, key=lambda c: kv_row_bytes(INT8_GROUP, c)), slm=self.use_slm)
        self.tokenizer = open_tokenizer(self.bundle)
        self._markup_tokens: dict[str, int | None] = {}
        self.backend_notes: dict[str, str] = {}  # role -> why backend "auto" runs it on ONNX Runtime
        self.llm = self._open("llm", options.exact_steps)
        try:
            if self.context_length > self.llm.capacity:  # TensorRT engines are built for a context of their own
                if options.context_length is not None:
                    raise InputError(f"context_length {self.context_length} exceeds the {self.llm.capacity} positions "
                                     f"the {self.llm.flavour} backend takes here: use at most {self.llm.capacity}")
                self.context_length = self.llm.capacity
            self._check_calibration_device()  # a warning an app turned into an error raises
        except BaseException:
            self.llm.close()  # now: the traceback keeps this engine, and an app that retries needs the memory
            raise
        self._slm: ModelBackend | None = None
        self._draft_vocabularies: dict[int, DraftVocabulary] = {}  # draft_rows -> what the SLM drafts from
        self._slm_lock = threading.Lock()
        self._lock = threading.Condition()  # guards the four below and _routers; notified as a call ends
        self._closed = False  # close() was called
        self._closing = False  # close() waits for the calls in progress: it frees what the engine holds
        self._released = False  # what the engine holds was freed (or is being freed)
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()  # every session made, while it lives
        self._calls: dict[Session, int] = {}  # the sessions in a call (Session._exclusive) -> its thread
        self.eos_ids = set(self.bundle.tokenizer.get("eos_token_ids") or [])
        self.options = options.decoding
        self._prefixes: dict[tuple[int, ...], dict[str, KVCache]] = {}  # shared system prompt -> role -> K/V
        self._prefix_lock = threading.Lock()
        self._routers: dict[str, TrainedRouter] = {}
        self._format_tokens: frozenset[int] | None = None
        self.grammars = GrammarCompiler(self.bundle.file(self.bundle.tokenizer["file"]), self.bundle.llm.arch.vocab_size,
                                        self.bundle.tokenizer.get("eos_token_ids") or [])

    @property
    def answer_memory(self) -> AnswerMemory | None:
        """The earlier answers ``speculate``'s prompt lookup drafts from (None: none)."""
        return self._answer_memory

    @answer_memory.setter
    def answer_memory(self, memory: AnswerMemory | None) -> None:
        """Refuses a memory learned with another vocabulary (another model's file, say) here,
        instead of a draft of a token the model does not have in the middle of an answer."""
        if memory is not None and not isinstance(memory, AnswerMemory):
            raise InputError(f"answer_memory is an AnswerMemory or None (got {type(memory).__name__}): "
                             "AnswerMemory.load(path) reads a saved one")
        vocab = self.bundle.llm.arch.vocab_size
        if memory is not None and (largest := memory.largest_id()) >= vocab:
            raise InputError(f"the answer memory holds token id {largest}, outside this bundle's vocabulary of "
                             f"{vocab}: it was learned with another model's tokenizer; give this bundle a memory "
                             "of its own (another --memory file)")
        self._answer_memory = memory

    @property
    def kv_dtype(self) -> str:
        """The KV cache type asked for ("auto" included); ``llm.kv_dtype`` is the one kept."""
        return self.settings.kv_dtype

    def _check_calibration_device(self) -> None:
        """Warn when the calibration's timings were taken on another kind of CPU or backend."""
        device = self.bundle.calibration.device if self.bundle.calibration else {}
        differences = []
        if device and (cpu := signature_difference(device, cpu_signature())):
            differences.append(cpu)
        if device.get("backend") and device["backend"] != self.llm.flavour:
            differences.append(f"calibrated with timings of the {device['backend']} backend; this engine runs "
                               f"{self.llm.flavour}")
        # a calibration that records its backend but not its cache predates the record, when
        # calibrate always ran on the float32 cache
        calibrated_kv = device.get("kv_dtype") or ("float32" if device.get("backend") else None)
        if calibrated_kv and calibrated_kv != self.llm.kv_dtype:
            unrecorded = "" if device.get("kv_dtype") else " (not recorded: calibrated before the record, on float32)"
            differences.append(f"calibrated on a {calibrated_kv} KV cache{unrecorded}; this engine keeps "
                               f"{self.llm.kv_dtype}")
        if differences:
            warnings.warn(f"{self.bundle.path}: {'; '.join(differences)}. Its quality budget holds; its timing-based "
                          "choices (draft length, --mode auto) may not be the fastest here: run `edgeroute calibrate` "
                          "on this kind of CPU and backend", CalibrationDeviceWarning, stacklevel=3)

    def _validate(self, options: DecodeOptions) -> None:
        """``options.validate`` against this engine: its layers, and whether it runs an SLM (and,
        where it does not, whether it was told not to)."""
        options.validate(self.bundle.llm.arch.num_layers, self.use_slm, not self.settings.slm)

    def _open(self, role: str, exact_steps: bool = False) -> ModelBackend:
        model, why_not_native = open_model(self.bundle, role, self.settings, exact_steps)
        if why_not_native is not None:
            self.backend_notes[role] = why_not_native
        return model

    @property
    def slm(self) -> ModelBackend | None:
        """The SLM, loaded on first use (None without one, or with ``slm=False``)."""
        if not self.use_slm:
            return None
        with self._slm_lock:
            self._check_open()
            if self._slm is None:
                self._slm = self._open("slm")
        return self._slm

    def draft_vocabulary(self, rows: int) -> DraftVocabulary | None:
        """What the SLM drafts from when it speculates with ``draft_rows`` ``rows``, made on first
        use; None where it reads its whole head: rows 0, or not fewer than its vocabulary, or an
        SLM not on the native kernels (whose head rows it reads)."""
        slm = self.slm
        if slm is None or not 0 < rows < slm.arch.vocab_size or slm.kernels is None:
            return None
        with self._slm_lock:
            if rows not in self._draft_vocabularies:
                added = [*self.tokenizer.get_added_tokens_decoder(), *self.eos_ids]
                self._draft_vocabularies[rows] = DraftVocabulary(slm, common_ids(slm.arch.vocab_size, rows, added))
            return self._draft_vocabularies[rows]

    # -- calibrated defaults --------------------------------------------------------------------

    def _trained_router(self, entry: RouterCalibration) -> TrainedRouter:
        with self._lock:
            self._check_open()
            if entry.file not in self._routers:
                self._routers[entry.file] = TrainedRouter(str(self.bundle.file(entry.file)), entry.features)
            return self._routers[entry.file]

    def resolve(self, options: DecodeOptions) -> DecodeOptions:
        """The options a generation runs with: mode auto and unset router choices taken from
        the bundle's calibration, format-critical tokens listed when the profile protects them."""
        calibration = self.bundle.calibration
        # auto's choice was judged on held-out tasks, and so was a calibrated skip setting, which a
        # skip mode takes when its own skip options are left at their defaults
        unmeasured_skip = options.skips and not (calibration is not None and calibration.decoding.get("skip")
                                                 and options.skip == SkipOptions())
        # and so was a route mode's router and threshold, where they are the calibration's
        unmeasured_route = options.base_mode == "route" and not calibrated_route(options, calibration)
        options = calibrated_options(options, calibration, self._trained_router)
        if unmeasured_skip or unmeasured_route:  # a bad option is its error alone, with no warning before it
            self._validate(options)
        if unmeasured_skip:
            warnings.warn(f"{self.bundle.path}: mode {options.mode} skips layers with uncalibrated settings (at most "
                          f"{options.skip.free_layers(self.llm.num_layers)} layers a decision, skip_ratio "
                          f"{options.skip.skip_ratio}): its quality is unmeasured until `edgeroute calibrate` keeps a "
                          "skip setting judged on held-out tasks", UnmeasuredQualityWarning, stacklevel=3)
        if unmeasured_route:
            warnings.warn(f"{self.bundle.path}: {options.label} routes with a router or threshold no calibration "
                          "fitted: its quality is unmeasured until `edgeroute calibrate` keeps a router for it judged "
                          "on held-out tasks", UnmeasuredQualityWarning, stacklevel=3)
        if options.protect_format and not options.protected_tokens:
            if self._format_tokens is None:
                self._format_tokens = format_token_ids(self.tokenizer.get_vocab())
            options = dataclasses.replace(options, protected_tokens=self._format_tokens)
        return options

    # -- text <-> tokens ------------------------------------------------------------------------

    @property
    def chat_format(self) -> dict[str, str]:
        chat_format = self.bundle.tokenizer.get("chat_format")
        if not chat_format:
            raise InputError("this bundle's model has no usable chat template: pass a plain prompt string")
        return chat_format

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def tool_format(self) -> ToolFormat:
        """How this model's prompts list tools and its answers call them (its own template's
        format, else the documented fallback: see :mod:`edgeroute.chat_format`)."""
        return tool_format(self.chat_format)

    def markup_token(self, text: str) -> int | None:
        """The id of the one added token that ``text`` is (Qwen2.5's ``<tool_call>``), else None."""
        if text not in self._markup_tokens:  # asked on every tool turn; the vocabulary never changes
            ids = self.encode(text)
            added = len(ids) == 1 and ids[0] in self.tokenizer.get_added_tokens_decoder()
            self._markup_tokens[text] = ids[0] if added else None
        return self._markup_tokens[text]

    def encode_prompt(self, prompt: str | Messages, tools: Tools | None = None) -> list[int]:
        check_prompt(prompt)
        return self._encode_checked_prompt(prompt, tools)

    def _encode_checked_prompt(self, prompt: str | Messages, tools: Tools | None) -> list[int]:
        """``encode_prompt`` of a prompt ``check_prompt`` passed (a session's turn checks it first)."""
        if isinstance(prompt, str) and not prompt.strip():
            raise InputError("the prompt is empty")
        if not isinstance(prompt, str) and not any(_said(m) for m in prompt):
            raise InputError("the messages are empty")
        try:
            text = prompt if isinstance(prompt, str) else format_messages(self.chat_format, list(prompt), list(tools or []))
        except (ValueError, KeyError, TypeError) as err:
            raise InputError(f"the messages do not form a chat: {err}") from None
        ids = self.encode(text)
        bos = self.bundle.tokenizer.get("bos_token_id")
        if self.bundle.tokenizer.get("add_bos_token") and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- sessions -------------------------------------------------------------------------------

    def session(self, tools: Tools | None = None, **options: Any) -> Session:
        """An independent sequence (its own KV caches) on this engine's shared sessions; a
        string prompt is plain text (a continuation). ``tools``: see :meth:`chat`."""
        self._check_open()
        return Session(self, self.resolve(self.options.updated(**options)), tools=tools)

    def chat(self, system: str | None = None, context_policy: str = "error", tools: Tools | None = None,
             **options: Any) -> Session:
        """Like ``session``, but a string prompt is a user turn in the chat template.

        ``system`` opens the conversation (it survives ``reset()`` and the context policy);
        when ``share_prefix`` computed it, the session starts from a copy of its K/V.
        ``context_policy`` says what a turn that does not fit the context does: "error" (the
        default) raises; "drop_oldest" forgets the oldest user/assistant exchanges (down to half
        the context), keeps the system prompt, and recomputes the cache from the first token
        that changed.

        ``tools`` (OpenAI function calling: ``{"type": "function", "function": {"name",
        "description", "parameters"}}``) are listed in the system prompt, so they stay for the
        chat's life. Each call may pass ``tool_choice`` ("auto", "required", "none" or
        ``{"type": "function", "function": {"name": ...}}``); the calls the model makes are
        grammar-constrained to its tools' parameter schemas and come back as
        ``Generation.tool_calls``; send their results as ``{"role": "tool", "tool_call_id",
        "content"}`` messages (the next call's prompt) and the chat goes on."""
        self._check_open()
        return Session(self, self.resolve(self.options.updated(**options)), chat=True, system=system,
                       context_policy=context_policy, tools=tools)

    def share_prefix(self, system: str, tools: Tools | None = None) -> int:
        """Compute a system prompt's K/V once for this engine: every ``chat(system=...)`` with
        the same text (and the same ``tools``: the template lists them in the system message)
        then starts from a copy instead of prefilling it, so its first turn's time to first
        token does not pay for the system prompt (the SLM's K/V, when a mode uses it, is
        computed once too, for the first session that needs it). The K/V stays in memory until
        the engine is closed. Returns the prefix length in tokens."""
        self._check_open()
        check_system_prompt(system)
        tokens = tuple(self.encode_prompt([{"role": "system", "content": system}], tools))
        if len(tokens) >= self.context_length:
            raise InputError(f"the system prompt needs {len(tokens)} tokens (its tools included) but the context holds "
                             f"{self.context_length}: a shared prefix must leave room for the turns; shorten it or "
                             "export with a larger --context-length")
        with self._prefix_lock:  # close() frees the prefixes under it: not before this prefill ends
            self._check_open()
            if tokens not in self._prefixes:
                self._prefixes[tokens] = {"llm": self._prefill(self.llm, tokens)}
        return len(tokens)

    def _prefill(self, model: ModelBackend, tokens: Sequence[int]) -> KVCache:
        cache = model.new_cache(len(tokens))  # exactly the prefix: it is only ever copied from
        model.forward(cache, tokens)
        return cache

    def _copy_shared_prefix(self, tokens: Sequence[int], cache: KVCache, role: str = "llm") -> int:
        """Start an empty cache of the LLM or the SLM from the longest shared prefix that
        ``tokens`` begin with (at least one token must stay to be computed: its logits pick
        the next token). Returns the number of positions copied."""
        with self._prefix_lock:
            matches = [p for p in self._prefixes if len(p) < len(tokens) and tuple(tokens[:len(p)]) == p]
            if not matches:
                return 0
            prefix = max(matches, key=len)
            caches = self._prefixes[prefix]
            if role not in caches:
                caches[role] = self._prefill(self.slm, prefix)
            cache.copy_from(caches[role])
            return len(prefix)

    def generate(self, prompt: str | Messages, tools: Tools | None = None, tool_choice: ToolChoice = None,
                 **options: Any) -> Generation:
        """One-shot generation in a fresh session; options override the engine's defaults."""
        return self.session(tools, **options).generate(prompt, tool_choice=tool_choice)

    def stream(self, prompt: str | Messages, tools: Tools | None = None, tool_choice: ToolChoice = None,
               **options: Any) -> Iterator[str]:
        return self.session(tools, **options).stream(prompt, tool_choice=tool_choice)

    async def agenerate(self, prompt: str | Messages, tools: Tools | None = None, tool_choice: ToolChoice = None,
                        **options: Any) -> Generation:
        """``generate`` awaited on an event loop (a fresh session; see :meth:`Session.astream`)."""
        return await self.session(tools, **options).agenerate(prompt, tool_choice=tool_choice)

    def astream(self, prompt: str | Messages, tools: Tools | None = None, tool_choice: ToolChoice = None,
                **options: Any) -> AsyncIterator[str]:
        return self.session(tools, **options).astream(prompt, tool_choice=tool_choice)

    # -- closing --------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the engine's memory now, instead of when the garbage collector finds it (an app
        that swaps bundles): every session's KV caches, the shared prefixes, the SLM and the LLM
        (the library's model and sessions, ONNX Runtime's sessions, TensorRT's engines and device
        memory). Any thread may call it; a call after the first returns at once.

        Generations in progress on the engine's sessions are cancelled (each ends within one
        token with finish_reason "cancelled", as ``cancel()`` ends it) and waited for (up to
        CANCELLED_WAIT_S in all); then everything is freed before ``close`` returns. A
        generation ``close`` cannot wait for (a stream this thread is iterating, ``close`` from
        an ``on_token`` callback, a stream whose consumer holds it past the wait) frees its
        session's caches as it ends, and the rest when it is the last.

        After it, every call that would run a model raises :class:`EngineClosed`: ``generate``,
        ``stream``, ``agenerate``, ``astream``, ``session``, ``chat``, ``share_prefix``,
        ``slm``, and the sessions' calls (``reset`` and ``barge_in`` too). The tokenizer keeps
        working (``encode``, ``decode``, ``encode_prompt``: text and ids of an answer already
        given), and so do what a session recorded (``last``, ``messages``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._closing = True
            running = list(self._calls)
        for session in running:
            session.cancel()
        me = threading.get_ident()
        with self._lock:
            # this thread's own generation (a stream it iterates) cannot end while it waits here
            self._lock.wait_for(lambda: all(thread == me for thread in self._calls.values()), timeout=CANCELLED_WAIT_S)
            self._closing = False
            idle = [session for session in self._sessions if session not in self._calls]
            release = self._release_due()
        for session in idle:
            session._release()
        if release:
            self._release()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            path = str(self.bundle.path)
            raise EngineClosed(f"the engine of {path} was closed (engine.close(), or the end of its with block): its "
                               f"models and caches are freed; open the bundle again: Engine({path!r})")

    def _adopt(self, session: Session) -> None:
        """Count a new session among the engine's (close() frees its caches); refused once closed."""
        with self._lock:
            self._check_open()
            self._sessions.add(session)

    def _enter(self, session: Session) -> None:
        """A call of ``session`` begins on this thread (under the session's guard)."""
        with self._lock:
            self._check_open()
            self._calls[session] = threading.get_ident()

    def _leave(self, session: Session) -> bool:
        """A call of ``session`` ended (under the session's guard): whether it frees what the
        engine holds (the engine closed during the call, this was the last call, and close()
        no longer waits)."""
        with self._lock:
            del self._calls[session]
            self._lock.notify_all()
            return self._release_due()

    def _release_due(self) -> bool:
        """Under ``_lock``: whether the caller frees what the engine holds (closed, no call runs,
        no close() waiting to do it, not freed yet); at most one caller is told so."""
        if not self._closed or self._closing or self._calls or self._released:
            return False
        self._released = True
        return True

    def _release(self) -> None:
        """Free the shared prefixes, routers and models: the engine is closed and no call runs
        (none can start), so nothing runs on them."""
        with self._prefix_lock:  # after a share_prefix in progress
            prefixes, self._prefixes = self._prefixes, {}
        for caches in prefixes.values():
            for cache in caches.values():
                close_cache(cache)
        with self._slm_lock:
            slm, vocabularies, self._draft_vocabularies = self._slm, self._draft_vocabularies, {}
        for vocabulary in vocabularies.values():
            vocabulary.close()
        with self._lock:
            self._routers = {}
        for model in (slm, self.llm):
            if model is not None:
                model.close()


CONTEXT_POLICIES = ("error", "drop_oldest")
# how long a call waits for a cancelled generation to stop (within one token: a prefill pass at
# most) before it is refused as SessionBusy; longer means an on_token callback holds the decode
CANCELLED_WAIT_S = 30.0


@dataclass
class Turn:
    """What a turn does to the sequence: keep its first ``keep`` tokens, append ``new``, and
    make ``messages`` the conversation so far (the new user message included)."""

    keep: int
    new: list[int]
    messages: list[dict[str, str]]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class Session:
    """One conversation. Chat turns append to the cached sequence, so each new user turn
    prefills only its own tokens; ``reset()`` starts over.

    One call at a time: ``generate``, ``stream``, ``generate_tokens`` or ``reset`` while a
    generation runs (from another thread, or from its own ``on_token`` callback) raises
    :class:`SessionBusy` and changes nothing; give each thread its own session.

    ``cancel()`` may come from any thread and stops the generation in progress within one
    token. A generation is in progress from the moment ``generate`` is called (or a
    ``stream`` / ``generate_tokens`` iterator is first advanced) until it returns; a cancel in
    that window before the first token ends it with no new tokens (finish_reason
    "cancelled"). A cancel while the session is idle does nothing: it never stops a later call.
    A call from another thread after a cancel waits for the cancelled generation to stop
    (within one token) instead of raising ``SessionBusy``.

    ``engine.close()`` cancels the session's generation in progress and frees its caches; its
    calls raise :class:`EngineClosed` after (``last`` and ``messages`` stay readable).
    """

    def __init__(self, engine: Engine, options: DecodeOptions, chat: bool = False, system: str | None = None,
                 context_policy: str = "error", tools: Tools | None = None) -> None:
        if context_policy not in CONTEXT_POLICIES:
            raise InputError(f"context policy {context_policy!r} is not one of {', '.join(CONTEXT_POLICIES)}")
        if system is not None:
            check_system_prompt(system)
            if not system.strip():
                raise InputError("the system prompt is empty: give none instead (system=None; no --system)")
        self.engine, self.options, self.chat, self.context_policy = engine, options, chat, context_policy
        self.tools = parse_tools(tools)
        self._calls_made = 0  # tool call ids are call_0, call_1, ... over the session's life
        engine._validate(options)
        try:
            # the SLM joins on the first call that needs it; None once the engine closed (_release)
            self.state: SequenceState | None = SequenceState(engine.llm, engine.context_length)
        except InputError:
            engine._check_open()  # a model closed meanwhile: say that the engine closed
            raise
        self._opening = [{"role": "system", "content": system}] if system is not None else []
        self.messages: list[dict[str, str]] = list(self._opening)
        self._cancel = threading.Event()  # the running call's: each call gets its own (_exclusive)
        self._guard = threading.Condition()  # guards _busy, _cancel and _owner; notified when idle
        self._busy = False
        self._owner: int | None = None  # the thread running the generation in progress
        self.last: Generation | None = None
        self._constraint: Constraint | None = None  # the running generation's response_format or tool grammar
        self._tool_choice: str | None = None  # the running generation's, None without tools
        self._fenced = False  # the running generation may make fenced calls (tools.fenced_calls)
        self._held: list[int] | None = None  # what the LLM cache's rows hold after a listen(), beyond self.state
        self._turn_start = self._answer_start = 0  # where the last turn's message and its answer begin
        self._task: str | None = None  # the running generation's task: its answer memory's key
        try:
            engine._adopt(self)
        except EngineClosed:
            self.state.close()
            raise

    # -- one call at a time ---------------------------------------------------------------------

    @contextmanager
    def _exclusive(self, cancel: threading.Event | None = None) -> Iterator[None]:
        """One call at a time; ``cancel``: the event that stops this call's generation (a fresh
        one by default), which ``cancel()`` sets while the call runs."""
        with self._guard:
            # a cancelled generation stops within one token: a call from another thread waits for
            # it instead of being refused, so a barge-in's cancel then barge_in() or the next turn
            # (the awaiting task cancelled, or cancel() from another thread) runs as soon as it can.
            # Its own thread (an on_token callback) would wait for itself: refused at once
            if self._busy and self._cancel.is_set() and self._owner != threading.get_ident():
                self._guard.wait_for(lambda: not self._busy, timeout=CANCELLED_WAIT_S)
            if self._busy:
                raise SessionBusy("this Session is already generating (in another thread, or this call comes from "
                                  "its own on_token callback): give each thread its own engine.session() or "
                                  "engine.chat(), or wait until the running call returns")
            self.engine._enter(self)  # EngineClosed once the engine is closed
            self._busy, self._owner = True, threading.get_ident()
            self._cancel = threading.Event() if cancel is None else cancel
        try:
            yield
        finally:
            if self.engine.closed:  # during this call: it frees what it used (close() waits for that)
                self._release()
            with self._guard:
                release_engine = self.engine._leave(self)
                self._busy = False
                self._guard.notify_all()
            if release_engine:  # the last call after a close() that could not wait for it
                self.engine._release()

    def _release(self) -> None:
        """Free the caches: the engine closed, and no call of this session runs but the caller's
        own, which is done with them (none can start). History (``messages``, ``last``) stays."""
        with self._guard:
            state, self.state = self.state, None
        if state is not None:
            state.close()

    def cancel(self) -> None:
        """Stop the generation in progress within one token (callable from any thread; does
        nothing while the session is idle)."""
        with self._guard:
            if self._busy:
                self._cancel.set()

    def reset(self) -> None:
        """Start over (a system prompt given to ``chat`` stays)."""
        with self._exclusive():
            self.state.reset()
            self.messages = list(self._opening)
            self._held = None

    # -- voice: listen ahead, barge in ------------------------------------------------------------

    def _cached_tokens(self) -> list[int]:
        """The tokens whose rows the LLM cache holds."""
        return (self.state.tokens if self._held is None else self._held)[:self.state.llm_cache.length]

    def listen(self, partial: str) -> int:
        """Listen ahead: prefill a partial transcript of the user's next message while they are
        still speaking (the ASR's partial results, each call with the whole message so far).
        The cache keeps what it shares with the last call and computes the rest; when the final
        transcript comes (``generate`` / ``stream`` with it), only its tokens after the prefix
        shared with what was prefilled are computed, so a partial that changed earlier words
        costs a recomputation from there, never a wrong answer: the answer is the one a cold
        prefill of the final text gives. The SLM is prefilled too where the session drafts with
        it. Returns the tokens computed by this call (0 for a message too long to hold)."""
        with self._exclusive():
            state = self.state
            turn = self._next_turn(partial)
            sequence = state.tokens[:turn.keep] + turn.new
            if len(sequence) >= state.capacity:
                return 0  # the final message will not fit either: generate says so then
            common = _common_prefix(self._cached_tokens(), sequence)
            state.llm_cache.truncate(common)
            if state.llm_cache.length == 0:
                self.engine._copy_shared_prefix(sequence, state.llm_cache)
            computed = sequence[state.llm_cache.length:]
            if computed:
                self.engine.llm.forward(state.llm_cache, computed)
            self._held = sequence
            if state.slm_drafter is None and self.options.uses_slm:
                state.attach_slm(self.engine.slm)
            drafter = state.slm_drafter
            if drafter is not None:
                if not drafter.seen:  # from the engine's shared system prompt, as a generation starts
                    drafter.seen = sequence[:self.engine._copy_shared_prefix(sequence, drafter.cache, "slm")]
                drafter.prefill(sequence)
            return len(computed)

    def barge_in(self, spoken: str | None = None) -> None:
        """The user spoke while the last answer was being said (its generation cancelled, or
        finished but not yet all spoken): keep the answer as far as ``spoken`` (the start of its
        text that was said) or, with None, forget the whole exchange (the user's message too).
        History and cache then hold exactly what a chat whose answer ended there (or that never
        had the exchange) holds, so the next turn gives the same tokens (a forgotten message's
        K/V rows are kept aside, as ``listen`` keeps a partial's: a next turn that begins the
        same way does not compute them again)."""
        with self._exclusive():
            last, state = self.last, self.state
            if last is None or not self.messages or self.messages[-1]["role"] != "assistant":
                raise InputError("barge_in cuts the chat's last answer, and this session has none")
            if spoken is None:
                held = self._cached_tokens()
                del state.tokens[self._turn_start:]
                del self.messages[-2:]
                self._held = held  # the forgotten message's rows stay: a retry of it (or listen) shares them
                return
            if not last.text.startswith(spoken):
                raise InputError(f"spoken must be the start of the last answer's text (got {spoken[:40]!r}, "
                                 f"the answer begins {last.text[:40]!r})")
            kept = 0
            while kept < len(last.tokens) and spoken.startswith(self.engine.decode(last.tokens[:kept + 1])) \
                    and last.tokens[kept] not in self.engine.eos_ids:
                kept += 1
            del state.tokens[self._answer_start + kept:]
            self.messages[-1] = {"role": "assistant", "content": self.engine.decode(last.tokens[:kept])}
            state.llm_cache.truncate(min(state.llm_cache.length, len(state.tokens)))
            self._held = None

    # -- turns ----------------------------------------------------------------------------------

    def _next_turn(self, prompt: str | Messages) -> Turn:
        """The turn appended to the conversation as it is. Changes nothing: a rejected turn
        leaves no trace."""
        check_prompt(prompt)
        engine, tokens = self.engine, self.state.tokens
        if isinstance(prompt, str) and not (self.chat or self.messages):
            if self.tools:
                raise InputError("tools go with chat messages: use engine.chat(tools=...) or pass a list of messages")
            if not tokens:
                return Turn(0, engine._encode_checked_prompt(prompt, None), [])
            if not prompt.strip():
                raise InputError("the prompt is empty")
            return Turn(len(tokens), engine.encode(prompt), [])  # plain-text continuation
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not any(_said(m) for m in messages):
            raise InputError("the messages are empty")
        if not tokens:
            if self._opening and messages[0].get("role") == "system":
                raise InputError("this chat already has a system prompt (chat(system=...)): send user messages only")
            # the template would open the user's next turn after them, and the model write the user's words
            if messages[-1].get("role") not in ("user", "tool"):
                raise InputError(f"the messages end with a message of role {messages[-1].get('role')!r}: an answer "
                                 "follows a user message (or tool results); add the user's message")
            return Turn(0, engine._encode_checked_prompt(self.messages + messages, self.tools), self.messages + messages)
        # a later chat turn: close the assistant's answer and append only the new message(s)
        drop_eos = tokens[-1] in engine.eos_ids  # the template's text below closes the turn
        fmt = engine.chat_format
        return Turn(len(tokens) - drop_eos, engine.encode(fmt["assistant_to_user"] + self._follow_up(messages) +
                                                          fmt["user_suffix"]), self.messages + messages)

    def _follow_up(self, messages: list[dict[str, Any]]) -> str:
        """The text of a later turn: one user message, or the results of the last answer's calls."""
        if len(messages) == 1 and messages[0].get("role") == "user" and (messages[0].get("content") or "").strip():
            return messages[0]["content"]
        called = {c["id"] for c in (self.messages[-1].get("tool_calls") or [])} if self.messages else set()
        if not called or not all(m.get("role") == "tool" for m in messages):
            raise InputError("a follow-up chat turn takes one non-empty user message, or (after an answer that "
                             'called tools) {"role": "tool", "tool_call_id": ..., "content": ...} messages')
        for m in messages:
            if not isinstance(m.get("content"), str) or m.get("tool_call_id", next(iter(called))) not in called:
                raise InputError(f"a tool result needs text content and the id of one of the last answer's calls "
                                 f"({', '.join(sorted(called))}); got {m!r:.120}")
        return self.engine.tool_format.results(messages)

    def _answer_room(self, options: DecodeOptions) -> tuple[int, int]:
        """(tokens an answer wants, positions kept free for speculative drafts)."""
        wanted = options.max_new_tokens or int(self.engine.bundle.generation["max_new_tokens"])
        return wanted, draft_lengths(options.draft_tokens, options.max_draft_tokens, self.engine.llm.pass_rows)[1] + 1

    def _drop_oldest(self, turn: Turn, options: DecodeOptions) -> Turn:
        """The ``drop_oldest`` context policy: when the turn and its whole answer budget do not
        fit, forget the oldest user/assistant exchanges (never the system prompt) until the
        conversation fills at most half the context, or only the new turn is left. The tokens
        are those of a fresh session fed the kept messages; the cache keeps what they share
        with the sequence so far (the system prompt) and recomputes the rest, so going down to
        half makes that recomputation rare (once per half a context of conversation)."""
        wanted, reserve = self._answer_room(options)
        capacity = self.state.capacity
        if self.context_policy == "error" or turn.keep + len(turn.new) + wanted + reserve <= capacity:
            return turn
        if not turn.messages:
            raise InputError("the drop_oldest context policy works on chat messages; this session continues plain "
                             "text: use engine.chat(), or reset() the session")
        opening = turn.messages[:1] if turn.messages[0]["role"] == "system" else []
        # 0: a first turn with no system prompt, all of it new
        new = next((i for i in range(len(turn.messages), 0, -1) if turn.messages[i - 1]["role"] not in ("user", "tool")),
                   0)
        exchanges, latest = turn.messages[len(opening):new], turn.messages[new:]
        # an exchange begins at a user message: its answer, calls and their results go with it;
        # tool results as the new turn keep the exchange whose answer called them
        starts = [i for i, m in enumerate(exchanges) if m["role"] == "user" and i > 0]
        starts += [] if latest[0]["role"] == "tool" else [len(exchanges)]
        if not starts:
            return turn  # the turn alone does not fit: the usual error follows
        for start in starts:
            messages = opening + exchanges[start:] + latest
            tokens = self.engine.encode_prompt(messages, self.tools)
            if len(tokens) + wanted + reserve <= capacity // 2:
                break
        if len(tokens) + wanted + reserve > capacity:
            return turn
        keep = min(_common_prefix(self.state.tokens, tokens), len(tokens) - 1)
        return Turn(keep, tokens[keep:], messages)

    def _constraint_for(self, options: DecodeOptions, tool_choice: ToolChoice) -> Constraint | None:
        """The request's response_format, or its tools' grammar (once per request)."""
        choice = parse_tool_choice(tool_choice, self.tools)
        if choice == "none" and options.response_format is not None:
            choice = None  # an answer in the format, not searched for calls: its grammar writes none
        self._tool_choice = choice
        self._fenced = fenced_calls(choice, self.engine.tool_format, self.engine.markup_token)
        if choice is None:
            return self.engine.grammars.compile(options.response_format)
        if options.stop:
            raise InputError("stop strings would cut a tool call where it may be incomplete: drop them with tools")
        if options.response_format is not None:
            raise InputError(f"response_format with tool_choice {choice!r}: an answer is either calls or in the format; "
                             "give tool_choice='none' with a response_format (an answer in it, no call)")
        grammar = tool_grammar(self.tools, choice, self.engine.tool_format, self.engine.markup_token)
        return self.engine.grammars.compile({"type": "grammar", "grammar": grammar}, "tools")

    def _begin(self, prompt: str | Messages, options: DecodeOptions,
               tool_choice: ToolChoice = None) -> tuple[Generation, Iterator[TokenTrace]]:
        """Check the turn, then set the sequence up for it: the first point of no return."""
        constraint = self._constraint_for(options, tool_choice)
        turn = self._drop_oldest(self._next_turn(prompt), options)
        state = self.state
        wanted, reserve = self._answer_room(options)
        room = state.capacity - turn.keep - reserve
        if len(turn.new) > room:
            # under drop_oldest the turn did not fit even alone: the policy is no way out
            policy = "" if self.context_policy == "drop_oldest" else "use engine.chat(context_policy='drop_oldest'), "
            raise InputError(f"the prompt needs {len(turn.new)} tokens but only {max(room, 0)} fit in the bundle's "
                             f"context of {state.capacity}: shorten it, reset() the session, {policy}or export with a "
                             "larger --context-length")
        budget = min(wanted, room - len(turn.new))
        if budget < 1:
            raise InputError("no room left in the context for new tokens: reset() the session")
        sequence = state.tokens[:turn.keep] + turn.new
        # the cache keeps what it shares with the turn's sequence: everything before the turn, and
        # what listen() prefilled of the message; a previous answer's end-of-turn marker (or turns the
        # policy dropped) is forgotten. One token at least is left to run, for the first logits.
        common = min(_common_prefix(self._cached_tokens(), sequence), len(sequence) - 1)
        start = max(turn.keep, common)
        state.tokens[:] = sequence[:start]
        state.llm_cache.truncate(min(state.llm_cache.length, common))
        self._held = None
        self._turn_start, self._answer_start = turn.keep, len(sequence)
        if state.llm_cache.length == 0:
            self.engine._copy_shared_prefix(sequence, state.llm_cache)
        self.messages = turn.messages
        if options.uses_slm and state.slm_drafter is None:
            state.attach_slm(self.engine.slm)
        drafter = state.slm_drafter
        if drafter is not None and not drafter.seen:
            sequence = state.tokens + turn.new
            drafter.seen = sequence[:self.engine._copy_shared_prefix(sequence, drafter.cache, "slm")]
        if drafter is not None:  # what the SLM drafts from where it speculates
            drafter.vocabulary = (self.engine.draft_vocabulary(options.draft_rows)
                                  if options.base_mode == "speculate" and options.uses_slm else None)
        memory = self.engine.answer_memory
        # only exact speculation drafts from memory: routing would accept its drafts unchecked
        state.ngram_drafter.memory = (memory.haystack(options.task) if memory is not None
                                      and options.base_mode == "speculate" else None)
        self._task = options.task
        decoder = Decoder(state, options, self._cancel, constraint)
        self._constraint = constraint
        self.last = Generation("", [], decoder.stats)
        return self.last, decoder.run(sequence[start:], budget, self.engine.eos_ids)

    def _finish(self, generation: Generation, text: str, finish: str) -> None:
        if self._tool_choice is not None:
            text = self._take_calls(generation)
        generation.text = text
        if self._cancel.is_set():
            finish = "cancelled"
        elif self._constraint is not None and not self._constraint.complete:
            finish = "incomplete"
        elif finish == "length" and self._constraint is not None and self._constraint.finished:
            # the budget ran out just before the end-of-sequence token the grammar forces: whole
            finish = "tool_calls" if generation.tool_calls else "eos"
        elif generation.tool_calls and finish == "eos":
            finish = "tool_calls"
        generation.finish_reason = finish
        memory = self.engine.answer_memory
        if memory is not None and memory.learning and finish != "cancelled":
            memory.remember(self._task, [t for t in generation.tokens if t not in self.engine.eos_ids])
        if self.messages:
            answer: dict[str, Any] = {"role": "assistant", "content": text}
            if generation.tool_calls:
                answer["tool_calls"] = [call.to_message() for call in generation.tool_calls]
            self.messages.append(answer)

    def _take_calls(self, generation: Generation) -> str:
        """The answer's content; its calls go to ``generation.tool_calls``."""
        tokens = [t for t in generation.tokens if t not in self.engine.eos_ids]
        raw = self.engine.tokenizer.decode(tokens, skip_special_tokens=False)

        def new_id() -> str:
            self._calls_made += 1
            return f"call_{self._calls_made - 1}"

        content, generation.tool_calls = split_tool_calls(raw, self.engine.tool_format, new_id, self._fenced)
        if generation.tool_calls:
            # the chat goes on from the calls as the template renders them: blank space the grammar
            # let the model write after them (and its end-of-turn token) is not history
            blank = 0
            for token in reversed(generation.tokens):
                if token not in self.engine.eos_ids and self.engine.decode([token]).strip():
                    break
                blank += 1
            if blank and self.state.tokens[-blank:] == generation.tokens[-blank:]:
                del self.state.tokens[-blank:]
        return content

    def _options(self, overrides: dict[str, Any]) -> DecodeOptions:
        options = self.engine.resolve(self.options.updated(**overrides)) if overrides else self.options
        self.engine._validate(options)
        return options

    # -- generation -----------------------------------------------------------------------------

    def generate_tokens(self, prompt: str | Messages, tool_choice: ToolChoice = None,
                        **overrides: Any) -> Iterator[TokenTrace]:
        """The new tokens' traces as they are decoded, with no text (benchmarks, token-level
        apps); ``self.last`` holds the generation."""
        options = self._options(overrides)
        with self._exclusive():
            generation, traces = self._begin(prompt, options, tool_choice)
            try:
                for trace in traces:
                    generation.tokens.append(trace.token)
                    generation.trace.append(trace)
                    yield trace
            finally:
                finish = "eos" if generation.tokens and generation.tokens[-1] in self.engine.eos_ids else "length"
                try:
                    self._finish(generation, self.engine.decode(generation.tokens), finish)
                finally:
                    traces.close()  # the decoder's own cleanup (drafts past the end) within the call

    def stream(self, prompt: str | Messages, on_token: Callable[[TokenTrace], None] | None = None,
               tool_choice: ToolChoice = None, on_tool_name: Callable[[str], None] | None = None,
               **overrides: Any) -> Iterator[str]:
        """Text pieces as they are decoded (a voice app speaks while the model writes). Each
        token's text is decoded once, from a short window; a tail that may begin a stop string
        is held back until it is known not to. With tools, only the content is streamed (the
        calls come in ``self.last.tool_calls`` at the end); ``on_tool_name`` gets each call's
        name as soon as it is decoded, before its arguments (on the decoding thread)."""
        return self._stream(None, prompt, on_token, tool_choice, on_tool_name, overrides)

    def _stream(self, cancel: threading.Event | None, prompt: str | Messages,
                on_token: Callable[[TokenTrace], None] | None, tool_choice: ToolChoice,
                on_tool_name: Callable[[str], None] | None, overrides: dict[str, Any]) -> Iterator[str]:
        """``stream``; ``cancel``: the event that stops this generation (``_exclusive``)."""
        options = self._options(overrides)
        with self._exclusive(cancel):
            generation, traces = self._begin(prompt, options, tool_choice)
            detokenizer, stops = IncrementalDetokenizer(self.engine.decode), StopFilter(options.stop)
            fmt = self.engine.tool_format
            content = None if self._tool_choice is None else \
                ContentFilter(fmt, self.engine.markup_token(fmt.call_open.strip()), self._fenced)
            names = None if self._tool_choice is None or on_tool_name is None else \
                CallNames(fmt, self.engine.markup_token(fmt.call_open.strip()),
                          self.engine.markup_token(fmt.call_close.strip()), self._fenced)
            shown: list[str] = []
            finish, last_text = "length", None
            try:
                for trace in traces:
                    generation.tokens.append(trace.token)
                    generation.trace.append(trace)
                    ended = trace.token in self.engine.eos_ids
                    if not ended:
                        trace.text, last_text = detokenizer.add(trace.token), trace
                    if on_token is not None:  # the trace covers every generated token, the end marker too
                        on_token(trace)
                    if names is not None and not ended and (name := names.push(trace.token, trace.text)):
                        on_tool_name(name)
                    if ended:
                        finish = "eos"
                        break
                    if piece := stops.push(trace.text if content is None else content.push(trace.token, trace.text)):
                        shown.append(piece)
                        yield piece
                    if stops.stopped:
                        finish = "stop"
                        break
                if finish != "stop":  # the end: what was held back is final now
                    tail = detokenizer.flush()
                    if last_text is not None:
                        last_text.text += tail
                    if content is not None:
                        tail = content.push(-1, tail) + content.flush()
                    if piece := stops.push(tail) + stops.flush():
                        shown.append(piece)
                        yield piece
            finally:
                try:
                    self._finish(generation, "".join(shown), finish)
                finally:
                    traces.close()  # the decoder's own cleanup (drafts past the end) within the call

    def generate(self, prompt: str | Messages, tool_choice: ToolChoice = None, **overrides: Any) -> Generation:
        for _ in self.stream(prompt, tool_choice=tool_choice, **overrides):
            pass
        return self.last

    # -- asyncio --------------------------------------------------------------------------------

    def astream(self, prompt: str | Messages, on_token: Callable[[TokenTrace], None] | None = None,
                tool_choice: ToolChoice = None, on_tool_name: Callable[[str], None] | None = None,
                **overrides: Any) -> AsyncIterator[str]:
        """``stream`` for an event loop: the decode runs on a worker thread once the stream is
        first awaited, and its pieces are awaited here. Cancelling the awaiting task, leaving
        the loop early (``break``) or ``aclose()`` stops this generation within one token (see
        :mod:`edgeroute.runtime.aio`); ``on_token`` and ``on_tool_name`` run on the worker."""
        return ThreadedStream(lambda stop: self._stream(stop, prompt, on_token, tool_choice, on_tool_name, overrides))

    async def agenerate(self, prompt: str | Messages, tool_choice: ToolChoice = None, **overrides: Any) -> Generation:
        """``generate`` for an event loop (see :meth:`astream`)."""
        async for _ in self.astream(prompt, tool_choice=tool_choice, **overrides):
            pass
        return self.last
