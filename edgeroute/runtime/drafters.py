"""Light paths: cheap proposals for the next tokens, behind one interface.

- :class:`NgramDrafter` (prompt lookup): continue the longest earlier match of the sequence's
  suffix in the prompt and history. Zero model compute; strong when answers echo the request
  (destinations, names, numbers, JSON keys).
- :class:`SlmDrafter`: the bundle's small model, greedy, with its own KV cache. With a
  reduced-vocabulary head it maps the head's columns back to token ids and never drafts a
  token outside them: where the head's "rest" column wins, the draft stops there.
- :class:`DraftVocabulary`: the tokens an SLM on the native backend drafts from when it
  speculates (common ids and the sequence's own), so that a drafted token reads a fraction of a
  large vocabulary's head (the LLM's verification keeps the output unchanged).
- :class:`LookupThenSlmDrafter` (``ngram+slm``, speculation only): the lookup's continuation
  where the sequence's suffix matched at least ``min_match`` earlier tokens, else the SLM. An
  answer that copies a span of its request (an address, a time, a JSON key) gets it drafted for
  free and several tokens at a time, and the SLM drafts the words in between; the SLM catches
  up on the copied tokens in one pass when it is next asked.

Each also proposes a :class:`DraftTree` (``propose_tree``) for backends that verify a tree in
one pass: the lookup's disagreeing continuations, the SLM's likeliest alternatives where it is
unsure, within a budget of tokens (:func:`tree_nodes`).

:class:`DraftLength` is the one rule for how long the next draft is; the decoder and the
calibration's replay of speculation (``calibration/drafting.py``) both follow it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from edgeroute.runtime.backend import Cache, ModelBackend
from edgeroute.runtime.sampling import softmax

if TYPE_CHECKING:
    from edgeroute.runtime.backends.native import NativeHeadRows, NativeModel


@dataclass
class Proposal:
    tokens: list[int]
    # per proposed token: the light path's own confidence signals for the router
    probabilities: list[np.ndarray | None]
    match_length: int = 0  # n-gram: length of the matched suffix
    match_count: int = 0  # n-gram: how often that suffix occurred earlier
    hidden: list[np.ndarray | None] = field(default_factory=list)  # SLM: last hidden state per token
    answer_position: int = 0  # tokens generated before the first proposed one (set by the decoder)
    source: str = ""  # the drafter that proposed the tokens ("ngram", "slm"; "": the light path's name)


@dataclass
class DraftTree:
    """Draft tokens that branch where the drafter saw several continuations: ``parents[i]`` is
    token i's parent, an earlier token of the tree, or -1 for the token after the sequence's last
    (so -1 tokens are alternatives for the next token). A single branch is a chain."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    source: str = ""
    match_length: int = 0  # lookup: the matched suffix's length (ngram+slm trusts long ones)

    def add(self, token: int, parent: int) -> int:
        """Appends ``token`` under ``parent``; its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        return len(self.tokens) - 1

    def add_branch(self, continuation: list[int], nodes: int | None = None) -> bool:
        """Merges ``continuation`` in: the prefix it shares with the tree's branches is not
        repeated. Where that would leave the tree more than ``nodes`` tokens, nothing is added
        (False)."""
        node, new = -1, []
        for step, token in enumerate(continuation):
            pairs = enumerate(zip(self.tokens, self.parents, strict=True))
            child = next((i for i, (t, p) in pairs if t == token and p == node), None)
            if child is None:
                new = continuation[step:]
                break
            node = child
        if nodes is not None and len(self.tokens) + len(new) > nodes:
            return False
        for token in new:
            node = self.add(token, node)
        return True

    def first_branch(self) -> list[int]:
        """The tokens of the branch added first (each node's first child): the drafter's own
        linear draft (the lookup's most recent continuation, the SLM's greedy chain)."""
        tokens, node = [], -1
        while (child := next((i for i, p in enumerate(self.parents) if p == node), None)) is not None:
            tokens.append(self.tokens[child])
            node = child
        return tokens

    @property
    def branches(self) -> int:
        """Its leaves: the continuations it holds."""
        return len(self.tokens) - len(set(self.parents) - {-1})

    @property
    def depth(self) -> int:
        """Tokens on its longest branch."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)


# The SLM adds an alternative at a draft position where it gives the token at least this
# probability: its top-1 is then unsure (below 1 - this), and a rarer alternative would
# seldom be the LLM's choice to pay for its verification row.
SIBLING_FLOOR = 0.1


def tree_nodes(nodes: int | None, pass_rows: int | None) -> int:
    """The most tokens a draft tree holds: ``nodes`` where set, else the longest linear draft's
    (:func:`longest_draft`), so that a tree spends the rows of one verification pass on
    alternatives instead of deeper guesses and never makes the pass longer than a linear draft
    could. Measured on the pair (2-core AVX-512 VNNI VM, 3-row passes): trees of 5 tokens (two
    passes' rows) ran 0.79-1.03x linear drafts, medians of paired prompts per workload (five),
    light path and thread count (docs/records/tree-speculation.json); the calibration replayed
    the SLM's 2-token trees at 1.05x its linear drafts and 5- or 8-token ones at 0.95-0.96x
    (docs/records/pair-calibration.json).
    ``edgeroute calibrate`` fits the shape per task from the device's measured costs."""
    return nodes if nodes is not None else longest_draft(pass_rows)


FIRST_DRAFT = 4  # the first draft's length when the caller sets none
LONGEST_DRAFT = 8  # the longest draft where the LLM's backend does not say what a pass serves


def longest_draft(pass_rows: int | None) -> int:
    """The longest draft when the caller sets none: one the LLM verifies in a single pass over
    its weights (the draft and the token before it: ``pass_rows`` rows), where the backend says
    how many rows a pass serves; else :data:`LONGEST_DRAFT`.

    Past a pass, each verification row costs another pass's arithmetic over weights that no
    longer come free with the memory traffic. On a compute-poor core that is most of a step:
    on an AVX2-only Zen 3 (the 1.5B, 4-row passes: a 5-token pass 1.9-2.2x a step) drafts grown
    to 8 ran speculate/slm at 1.15x ``full`` (1 thread) and 1.26x (2), drafts of at most 3 at
    1.35x and 1.59x, the same tokens (docs/measured/2026-12-03-avx2-passes-drafts.md). With
    AVX-512 VNNI (3-row passes, a row +6 ms on a 48 ms step) the replayed cost model puts 2- and
    3-token drafts within 1% of each other.
    ``edgeroute calibrate`` fits the longest draft from measured pass costs instead."""
    return max(pass_rows - 1, 1) if pass_rows else LONGEST_DRAFT


def draft_lengths(first: int | None, longest: int | None, pass_rows: int | None) -> tuple[int, int]:
    """(first, longest) draft lengths from the caller's (None: not set): an unset longest is
    :func:`longest_draft`, or the first draft asked for where that is longer; an unset first is
    :data:`FIRST_DRAFT`, at most the longest."""
    if longest is None:
        longest = max(longest_draft(pass_rows), first or 1)
    return (min(FIRST_DRAFT, longest) if first is None else first), longest


@dataclass
class DraftLength:
    """How many tokens the next draft asks for: ``first`` at the start of a generation, one more
    after a draft accepted whole (up to ``longest``), one less after a draft less than half
    accepted (down to 1), unchanged otherwise or when not ``adaptive``."""

    first: int
    longest: int
    adaptive: bool = True
    current: int = field(init=False)

    def __post_init__(self) -> None:
        self.current = self.first

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or not drafted:
            return
        if accepted == drafted:
            self.current = min(self.current + 1, self.longest)
        elif accepted < drafted / 2:
            self.current = max(self.current - 1, 1)


def draft_source(proposal: Proposal, light) -> str:
    """A drafted token's trace source: the drafter that proposed it (a light path that mixes
    drafters names each), else the light path."""
    return f"draft:{proposal.source or light.name}"


class NgramDrafter:
    """Prompt lookup over the sequence so far and, where ``memory`` holds earlier answers (an
    :class:`~edgeroute.runtime.answer_memory.AnswerMemory` haystack, set per generation by the
    session), over those too: the longer match drafts (the sequence's own on a tie)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.memory: np.ndarray | None = None

    def propose(self, tokens: list[int], k: int) -> Proposal:
        """The k tokens that followed the most recent earlier occurrence of the longest
        suffix (max_ngram down to min_ngram tokens) of ``tokens``; where the memory matched a
        longer suffix, the continuation most of its matches share."""
        n, continuations = self._continuations(tokens, k, 1)
        if n == 0:
            return Proposal([], [], source=self.name if len(tokens) > self.min_ngram else "")
        count, continuation = continuations[0]
        return Proposal(continuation, [None] * len(continuation), n, count, source=self.name)

    def propose_tree(self, tokens: list[int], k: int, branches: int, nodes: int | None = None) -> DraftTree:
        """The k tokens after each of the most recent earlier occurrences of the longest suffix
        (as ``propose``; from the memory, the most frequent first), up to ``branches`` different
        continuations, merged where they agree: where the matches disagree, the tree holds each.
        With ``nodes``, the first continuation is cut to it and another is added only where it
        fits."""
        n, continuations = self._continuations(tokens, min(k, nodes or k), branches)
        tree = DraftTree(source=self.name, match_length=n)
        for _, continuation in continuations:
            tree.add_branch(continuation, nodes)
        return tree

    def _continuations(self, tokens: list[int], k: int, most: int) -> tuple[int, list[tuple[int, list[int]]]]:
        """The longest matched suffix's length and up to ``most`` different continuations of at
        most k tokens, each with how many matches it follows: the sequence's own, most recent
        first, or the memory's where it matched longer, most frequent first."""
        seq = np.asarray(tokens, np.int64)
        n, ends = self._matches(seq, seq)  # an earlier place of the suffix: its last token is never one
        if self.memory is not None and self.memory.size:
            remembered, memory_ends = self._matches(self.memory, seq)
            if remembered > n:
                counts: dict[tuple[int, ...], int] = {}
                for end in memory_ends:
                    following = self.memory[end + 1:end + 1 + k]
                    stop = np.flatnonzero(following < 0)
                    key = tuple(int(t) for t in following[:stop[0] if stop.size else k])
                    counts[key] = counts.get(key, 0) + 1
                ranked = sorted(counts.items(), key=lambda item: -item[1])  # stable: older answers first on ties
                return remembered, [(count, list(key)) for key, count in ranked[:most]]
        continuations: list[tuple[int, list[int]]] = []
        seen: set[tuple[int, ...]] = set()
        for end in ends[::-1]:
            key = tuple(tokens[int(end) + 1:int(end) + 1 + k])
            if key not in seen:
                seen.add(key)
                continuations.append((int(ends.size), list(key)))
            if len(continuations) == most:
                break
        return n, continuations

    def _matches(self, haystack: np.ndarray, seq: np.ndarray) -> tuple[int, np.ndarray]:
        """The longest suffix of ``seq`` (max_ngram down to min_ngram tokens) that ``haystack``
        holds followed by a token (``seq`` itself: an earlier occurrence), and where those
        occurrences end (ascending); (0, none) without one. Matches never cross a negative
        separator (no token equals one)."""
        longest = min(self.max_ngram, seq.size - 1)
        if longest < self.min_ngram or haystack.size < 2:
            return 0, np.empty(0, np.int64)
        # Places of the last token (each followed by a token) are the only places a match can
        # end: one pass over the haystack, then at most max_ngram steps back over these few,
        # instead of comparing every window of every length.
        ends = np.flatnonzero(haystack[:-1] == seq[-1])
        ends = ends[haystack[ends + 1] >= 0]
        matched = np.ones(ends.size, np.int64)  # suffix tokens matched backwards from each end
        alive = np.ones(ends.size, bool)
        for back in range(1, longest):
            before = ends - back
            alive &= before >= 0
            alive[alive] = haystack[before[alive]] == seq[-1 - back]
            matched += alive
        for n in range(longest, self.min_ngram - 1, -1):
            hits = ends[matched >= n]
            if hits.size:
                return n, hits
        return 0, np.empty(0, np.int64)

    def reset(self) -> None:
        pass

    def sync(self, tokens: list[int]) -> None:
        pass


class DraftVocabulary:
    """What a speculating SLM drafts from: its head's rows of ``common`` ids (the lowest ids,
    which a BPE vocabulary numbers in merge order, the most frequent first, and the tokenizer's
    added tokens), and per sequence the rows of its own other ids (the names, numbers and
    words an answer copies from its request). A drafted token then reads those rows instead of
    the whole head: the Qwen2.5-Coder-0.5B's head is 144 MB of the 390 MB a step reads; 32,768
    common rows are 31 MB. A token outside both is never drafted (the LLM writes it at the
    verification that rejects the draft there), so the output is the LLM's either way. On the
    pair's four workloads speculate/slm ran 0.99-1.11x its whole head's speed (median 1.04x),
    its acceptance 0-6 points lower (docs/benchmarks.md, *The SLM's draft vocabulary*). Built on
    the model's ``head_rows`` (the native backend)."""

    def __init__(self, model: NativeModel, common: Sequence[int] | np.ndarray) -> None:
        self.model, self.vocab_size = model, model.arch.vocab_size
        self.common = model.head_rows(np.unique(np.asarray(common, np.int64)))
        self.covered = np.zeros(self.vocab_size, bool)
        self.covered[self.common.ids] = True

    def sequence_rows(self, tokens: Sequence[int], rows: NativeHeadRows | None = None) -> NativeHeadRows | None:
        """Head rows of the ids of ``tokens`` that the common rows lack, and of ``rows`` (an
        earlier call's, for the sequence's tokens before these): ``rows`` itself where it has
        them all, else new rows of both; None where there are none."""
        ids = np.unique(np.asarray(tokens, np.int64))
        extra = ids[~self.covered[ids]]
        if not extra.size or (rows is not None and np.isin(extra, rows.ids).all()):
            return rows
        if rows is not None:
            extra = np.union1d(rows.ids, extra)
            rows.close()
        return self.model.head_rows(extra)

    def close(self) -> None:
        """Frees the common rows (the engine closing)."""
        self.common.close()

    def logits(self, hidden: np.ndarray, rows: NativeHeadRows | None) -> np.ndarray:
        """Full-vocabulary logits [T, vocab] of hidden states [T, d]: the common rows' and the
        sequence ``rows``' columns, -inf for every other token."""
        full = np.full((hidden.shape[0], self.vocab_size), -np.inf, np.float32)
        full[:, self.common.ids] = self.common.logits(hidden)
        if rows is not None:
            full[:, rows.ids] = rows.logits(hidden)
        return full


def common_ids(vocab_size: int, rows: int, added: Sequence[int]) -> np.ndarray:
    """The ids :class:`DraftVocabulary` keeps for every sequence: the ``rows`` lowest, the
    ``added`` ones (special and chat tokens), all below ``vocab_size``."""
    ids = np.union1d(np.arange(min(rows, vocab_size)), np.asarray(list(added), np.int64))
    return ids[ids < vocab_size]


class SlmDrafter:
    name = "slm"

    def __init__(self, model: ModelBackend, capacity: int | None = None) -> None:
        self.model = model
        self.cache: Cache = model.new_cache(capacity)
        self.seen: list[int] = []  # the tokens whose K/V the cache holds
        self.last_logits: np.ndarray | None = None  # the head's own columns (reduced or full)
        self.last_hidden: np.ndarray | None = None  # [d], the last hidden state behind last_logits
        # what every logit it gives comes from: set per generation by the session, where the SLM
        # speculates (its tokens are only proposals); None, its whole head, for routing and the
        # SLM alone
        self.vocabulary: DraftVocabulary | None = None
        self._sequence_rows: NativeHeadRows | None = None  # vocabulary.sequence_rows of seen[:_rows_through]
        self._rows_through = 0
        self._rows_vocabulary: DraftVocabulary | None = None  # what _sequence_rows and last_logits came from

    def reset(self) -> None:
        self.cache.reset()
        self.seen = []
        self.last_logits = self.last_hidden = None
        self.close_rows()

    def close_rows(self) -> None:
        """Frees the sequence's own head rows (made again when next drafted from)."""
        if self._sequence_rows is not None:
            self._sequence_rows.close()
            self._sequence_rows = None
        self._rows_through = 0

    def sync(self, tokens: list[int]) -> None:
        """Forget cached positions that disagree with ``tokens`` (rejected drafts, tokens the
        LLM replaced), so the next call catches up on the real sequence."""
        n = min(len(self.seen), len(tokens))
        differ = np.flatnonzero(np.asarray(self.seen[:n]) != np.asarray(tokens[:n]))
        keep = int(differ[0]) if differ.size else n
        if keep < len(self.seen):
            # ``tokens`` a prefix of what was seen: its last token is run again, for its logits
            keep = max(min(keep, len(tokens) - 1), 0)
            self.cache.truncate(keep)
            del self.seen[keep:]
            self._rows_through = min(self._rows_through, keep)
            self.last_logits = None

    def prefill(self, tokens: list[int]) -> None:
        """Catch the cache up on ``tokens`` now (listen-ahead), keeping what it shares with them."""
        self.sync(tokens)
        new = tokens[len(self.seen):]
        if new or self.last_hidden is None:
            self.last_hidden = self.model.hidden_states(self.cache, new)[-1]
            self.last_logits = None
            self.seen.extend(new)

    def _head_logits(self, tokens: list[int]) -> np.ndarray:
        self.prefill(tokens)
        vocabulary = self.vocabulary
        if vocabulary is not self._rows_vocabulary:
            self.close_rows()
            self.last_logits, self._rows_vocabulary = None, vocabulary
        if vocabulary is not None and self._rows_through < len(tokens):
            # only the tokens since the last call: ``seen`` (now ``tokens``) kept the ones before
            self._sequence_rows = vocabulary.sequence_rows(tokens[self._rows_through:], self._sequence_rows)
            self._rows_through = len(tokens)
        if self.last_logits is None:
            hidden = self.last_hidden[None]
            self.last_logits = (self.model.head(hidden) if vocabulary is None
                                else vocabulary.logits(hidden, self._sequence_rows))[0]
        return self.last_logits

    def next_logits(self, tokens: list[int]) -> np.ndarray:
        """Logits over the full vocabulary (-inf for tokens outside a reduced head, or outside
        the drafter's ``vocabulary``)."""
        logits = self._head_logits(tokens)
        vocab = self.model.head_vocab
        return logits if vocab is None else vocab.expand(logits)

    def propose(self, tokens: list[int], k: int, min_confidence: float = 0.0) -> Proposal:
        """Up to k greedy tokens of the SLM (catching up on tokens it has not seen first);
        fewer when a reduced head's rest column wins (a token it cannot draft comes next) or
        the next token's probability is below ``min_confidence`` (an unsure guess costs an SLM
        step and a verification row, and is mostly rejected)."""
        proposal = Proposal([], [], source=self.name)
        sequence = list(tokens)
        vocab = self.model.head_vocab
        for _ in range(k):
            if vocab is not None and vocab.rest_wins(self._head_logits(sequence)):
                break
            p = softmax(self.next_logits(sequence))
            token = int(np.argmax(p))
            if p[token] < min_confidence:
                break
            proposal.tokens.append(token)
            proposal.probabilities.append(p)
            proposal.hidden.append(self.last_hidden)
            sequence.append(token)
        return proposal

    def propose_tree(self, tokens: list[int], k: int, width: int, nodes: int,
                     min_confidence: float = 0.0) -> DraftTree:
        """The greedy draft of ``propose`` (up to k tokens, at most ``nodes`` in all) as a chain,
        with alternatives where the SLM is unsure: at each position, up to ``width`` - 1 more of
        its likeliest tokens that it gives at least :data:`SIBLING_FLOOR`, as leaves beside the
        chain's token (the SLM runs the chain only: an alternative costs a verification row, no
        SLM step). Where the chain's token is below ``min_confidence`` (where ``propose`` stops),
        its candidates end the tree if together they reach it, else nothing more is drafted."""
        tree = DraftTree(source=self.name)
        sequence, parent = list(tokens), -1
        vocab = self.model.head_vocab
        while tree.depth < k and len(tree.tokens) < nodes:
            if vocab is not None and vocab.rest_wins(self._head_logits(sequence)):
                break
            p = softmax(self.next_logits(sequence))
            top = np.argpartition(p, -width)[-width:] if width < p.size else np.arange(p.size)
            top = top[np.argsort(-p[top], kind="stable")]
            candidates = [int(t) for i, t in enumerate(top) if i == 0 or p[t] >= SIBLING_FLOOR]
            candidates = candidates[:nodes - len(tree.tokens)]
            sure = p[candidates[0]] >= min_confidence
            if not sure and p[candidates].sum() < min_confidence:
                break
            chain = tree.add(candidates[0], parent)
            for token in candidates[1:]:
                tree.add(token, parent)
            if not sure:
                break
            parent = chain
            sequence.append(candidates[0])
        return tree


class ConfidentSlmDrafts:
    """One generation's view of a session's SLM drafter: drafts end before a token the SLM gives
    less probability than ``min_confidence`` (``DecodeOptions.draft_confidence``). The drafter
    itself, with its cache, is shared by the session's generations and stays as it is."""

    name = SlmDrafter.name

    def __init__(self, drafter: SlmDrafter, min_confidence: float) -> None:
        self.drafter, self.min_confidence = drafter, min_confidence

    def propose(self, tokens: list[int], k: int) -> Proposal:
        return self.drafter.propose(tokens, k, self.min_confidence)

    def propose_tree(self, tokens: list[int], k: int, width: int, nodes: int) -> DraftTree:
        return self.drafter.propose_tree(tokens, k, width, nodes, self.min_confidence)


class LookupThenSlmDrafter:
    """Prompt lookup where its match is long enough to trust, the SLM elsewhere. The lookup's
    drafts are ``lookup_tokens`` long (they cost no model step; a rejected one costs only its
    verification row), the SLM's ``k`` (the decoder adapts it to the SLM's acceptance)."""

    name = "ngram+slm"
    adaptive_source = "slm"  # whose acceptance the decoder's draft length follows

    def __init__(self, lookup: NgramDrafter, slm: SlmDrafter | ConfidentSlmDrafts, min_match: int = 3,
                 lookup_tokens: int = 4) -> None:
        if min_match < 1 or lookup_tokens < 1:
            raise ValueError(f"min_match and lookup_tokens must be >= 1 (got {min_match}, {lookup_tokens})")
        self.lookup, self.slm = lookup, slm
        self.min_match, self.lookup_tokens = min_match, lookup_tokens

    def propose(self, tokens: list[int], k: int) -> Proposal:
        lookup = self.lookup.propose(tokens, self.lookup_tokens)
        if lookup.tokens and lookup.match_length >= self.min_match:
            return lookup
        return self.slm.propose(tokens, k)

    def propose_tree(self, tokens: list[int], k: int, width: int, nodes: int) -> DraftTree:
        """The lookup's tree (up to ``width`` continuations where its matches disagree) where its
        match is long enough, else the SLM's (its alternatives where it is unsure)."""
        # the lookup's first continuation is as long as its linear draft (lookup_tokens: it costs
        # no model step); its other continuations fit in what the budget leaves
        lookup = self.lookup.propose_tree(tokens, self.lookup_tokens, width, max(nodes, self.lookup_tokens))
        if lookup.tokens and lookup.match_length >= self.min_match:
            return lookup
        return self.slm.propose_tree(tokens, k, width, nodes)
