"""Tree forwards through the Python binding (``NativeModel.forward_tree`` / ``keep_path``) on the
demo bundle: every token of a tree has its root-to-token path's logits bit for bit on each kernel
set and cache format, a kept path leaves the cache a linear run's, bad trees and paths are
InputErrors naming the fault, and a backend without trees says so (``tree_forwards``).
tests/native/test_tree.c holds the library to the same on every kernel set, emulated CPUs included.
Then their use: prompt-lookup drafts that branch where earlier matches disagree and SLM drafts
that branch where the SLM is unsure (``--light ngram``, ``slm``, ``ngram+slm``), verified greedily
in one tree forward, decode ``full``'s tokens; sampling and grammars keep linear drafts. The tiny
random bundles of conftest carry no native weights (export writes them for GGUF-carried int4
only; tests/test_native.py pins that they run on ONNX Runtime): trees run on the demo bundle."""

from __future__ import annotations

import numpy as np
import pytest

from edgeroute.bundle import Bundle
from edgeroute.errors import InputError, NativeBackendUnavailable
from edgeroute.runtime import Engine
from edgeroute.runtime.backends.onnxruntime import OrtModel
from edgeroute.runtime.drafters import SIBLING_FLOOR, NgramDrafter, SlmDrafter, tree_nodes

native = pytest.importorskip("edgeroute.runtime.backends.native")

# Two alternatives for the next token (0 and 5), branching again at 0 and 3, in an order that
# interleaves the branches: most tokens' ancestors lie among other tokens' rows.
PARENTS = [-1, 0, 0, 1, 2, -1, 5, 3, 3, 6]
WORDS = [" take", " a", " get", " short", " some", " rest", " for", " nap", " walk", " a"]
PROMPT = "Three tips for staying awake on a long drive: first, pull over and"


def unavailable(kernels: str) -> str | None:
    try:
        native.native_library(kernels)
    except NativeBackendUnavailable as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def demo(smollm2_bundles) -> Bundle:
    return Bundle.open(smollm2_bundles["int4"][0])


@pytest.fixture(scope="module")
def texts(demo) -> tuple[list[int], list[int]]:
    """The prompt's ids and the tree's (a word each)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo.file("tokenizer.json")))
    return tokenizer.encode(PROMPT).ids, [tokenizer.encode(word).ids[0] for word in WORDS]


def path_to(token: int) -> list[int]:
    path = [token]
    while PARENTS[path[0]] >= 0:
        path.insert(0, PARENTS[path[0]])
    return path


def prefilled(model, ids: list[int]):
    cache = model.new_cache(128)
    model.forward(cache, ids)
    return cache


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("kernels", ["auto", "avx2", "generic"])
def test_each_tree_token_has_its_paths_logits_bit_for_bit(demo, texts, kernels, kv_dtype):
    if unavailable(kernels):
        pytest.skip(f"the {kernels} kernels: {unavailable(kernels)}")
    prompt, tree = texts
    model = native.NativeModel(demo, kv_dtype=kv_dtype, kernels=kernels)
    assert model.tree_forwards
    prefix = prefilled(model, prompt)
    cache = prefix.clone()
    got = model.forward_tree(cache, tree, PARENTS)
    assert got.shape == (len(tree), model.arch.vocab_size) and cache.length == len(prompt) + len(tree)
    linear = model.forward(prefix.clone(), tree, all_logits=True)  # the same tokens without the tree's mask
    for token in range(len(tree)):
        alone = prefix.clone()
        want = model.forward(alone, [tree[i] for i in path_to(token)])
        assert np.array_equal(got[token], want), f"token {token} ({model.kernels}, {kv_dtype})"
        # the first two tokens are a chain from the prompt: linear either way; the others see other branches
        assert np.array_equal(linear[token], want) == (token < 2), token


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_a_kept_path_leaves_the_cache_of_a_linear_run(demo, texts, kv_dtype):
    prompt, tree = texts
    model = native.NativeModel(demo, kv_dtype=kv_dtype)
    cache, linear = prefilled(model, prompt), prefilled(model, prompt)
    path = path_to(9)
    model.forward_tree(cache, tree, PARENTS)
    model.keep_path(cache, path)
    model.forward(linear, [tree[i] for i in path])
    end = len(prompt) + len(path)
    assert cache.length == linear.length == end
    assert np.array_equal(cache.keys[..., :end, :], linear.keys[..., :end, :])
    assert np.array_equal(cache.values[..., :end, :], linear.values[..., :end, :])
    next_token = tree[0]
    assert np.array_equal(model.forward(cache, [next_token]), model.forward(linear, [next_token]))
    model.forward_tree(cache, tree, PARENTS)
    model.keep_path(cache, [])  # none kept: the cache as before the tree
    assert cache.length == end + 1


@pytest.mark.slow
def test_bad_trees_and_paths_are_input_errors_that_change_nothing(demo, texts):
    prompt, tree = texts
    model = native.NativeModel(demo, kernels="generic", threads=1)
    cache = prefilled(model, prompt)
    for parents, says in [([-1, 0, 3, 1], "does not come before it"), ([-1, 1, 0, 1], "does not come before it"),
                          ([-1, 0, -2, 1], "outside -1..3"), ([-1, 0, 4, 1], "outside -1..3"),
                          ([-1, 0, 0], "one integer per token"), ([-1, 0, 0.5, 1], "one integer per token")]:
        with pytest.raises(InputError, match=says):
            model.forward_tree(cache, tree[:4], parents)
        assert cache.length == len(prompt)
    with pytest.raises(InputError, match="no tree"):
        model.keep_path(cache, [0])
    model.forward_tree(cache, tree, PARENTS)
    for path, says in [([1, 3], "is a chain"), ([0, 3], "is a chain"), ([0, 2, 7], "is a chain"),
                       ([0, 1, 10], "outside the tree")]:
        with pytest.raises(InputError, match=says):
            model.keep_path(cache, path)
        assert cache.length == len(prompt) + len(tree)
    model.keep_path(cache, [0, 1, 3])
    with pytest.raises(InputError, match="no tree"):  # a tree's path is kept once
        model.keep_path(cache, [0])


@pytest.mark.slow
def test_onnx_runtime_runs_no_trees_and_says_so(demo, texts):
    """The decoder falls back to linear drafts where ``tree_forwards`` is False."""
    prompt, tree = texts
    model = OrtModel(demo)
    assert not model.tree_forwards
    cache = prefilled(model, prompt)
    with pytest.raises(InputError, match="runs no tree forwards"):
        model.forward_tree(cache, tree, PARENTS)
    assert cache.length == len(prompt)


def test_lookup_drafts_branch_where_earlier_matches_disagree():
    """The suffix 5 1 2 occurred three times, followed by 3 9 5, 4 8 5 and 3 7 0: three branches,
    the most recent first, sharing their common first token; with room for two, the two most recent."""
    tokens = [5, 1, 2, 3, 9, 5, 1, 2, 4, 8, 5, 1, 2, 3, 7, 0, 5, 1, 2]
    tree = NgramDrafter().propose_tree(tokens, 3, 4)
    assert (tree.tokens, tree.parents) == ([3, 7, 0, 4, 8, 5, 9, 5], [-1, 0, 1, -1, 3, 4, 0, 6])
    assert tree.branches == 3 and tree.depth == 3 and tree.source == "ngram"
    assert NgramDrafter().propose(tokens, 3).tokens == [3, 7, 0]  # the linear draft: the most recent branch
    two = NgramDrafter().propose_tree(tokens, 3, 2)
    assert (two.tokens, two.parents, two.branches) == ([3, 7, 0, 4, 8, 5], [-1, 0, 1, -1, 3, 4], 2)
    assert NgramDrafter().propose_tree([1, 2, 3], 3, 4).tokens == []  # no earlier match
    # within 5 tokens: the second continuation (3 more) does not fit, the third (2 more, beside 3) does
    five = NgramDrafter().propose_tree(tokens, 3, 4, nodes=5)
    assert (five.tokens, five.parents, five.match_length) == ([3, 7, 0, 9, 5], [-1, 0, 1, 0, 3], 3)


class TableSlm:
    """A stand-in SLM over 8 tokens whose next-token distribution is ``TABLE_P[i]`` at the i-th
    position after the prompt: sure, unsure between three, sure again."""

    TABLE_P = [{1: 0.95}, {2: 0.5, 3: 0.3, 4: 0.15}, {6: 0.9}]
    head_vocab = None

    def __init__(self, prompt: int) -> None:
        self.prompt = prompt

    def new_cache(self, capacity):
        from types import SimpleNamespace
        return SimpleNamespace(truncate=lambda n: None, reset=lambda: None)

    def hidden_states(self, cache, ids):
        self.length = getattr(self, "length", 0) + len(ids)
        return np.zeros((max(len(ids), 1), 2), np.float32)

    def head(self, hidden):
        p = np.full(8, 1e-4)
        for token, q in self.TABLE_P[self.length - self.prompt].items():
            p[token] = q
        return np.log(p)[None]


def test_slm_drafts_branch_into_its_likeliest_tokens_where_it_is_unsure():
    """Beside the chain of its top tokens, the SLM's alternatives (at least SIBLING_FLOOR) where
    it is unsure, as leaves, within the budget of tokens; below min_confidence the candidates end
    the tree if together they reach it."""
    assert SIBLING_FLOOR == 0.1  # the table's 0.15 alternative branches, the 0.05 remainder does not
    prompt = [7, 7]

    def tree(k, width, nodes, confidence=0.0):
        drafted = SlmDrafter(TableSlm(len(prompt))).propose_tree(prompt, k, width, nodes, confidence)
        assert drafted.source == "slm"
        return drafted.tokens, drafted.parents

    assert tree(3, 3, 8) == ([1, 2, 3, 4, 6], [-1, 0, 0, 0, 1])
    drafted = SlmDrafter(TableSlm(len(prompt))).propose_tree(prompt, 3, 3, 8)
    assert drafted.first_branch() == [1, 2, 6] and drafted.branches == 3 and drafted.depth == 3  # the greedy chain
    assert tree(3, 2, 8) == ([1, 2, 3, 6], [-1, 0, 0, 1])  # width 2: one alternative
    assert tree(3, 3, 3) == ([1, 2, 3], [-1, 0, 0])  # the budget
    assert tree(2, 3, 8) == ([1, 2, 3, 4], [-1, 0, 0, 0])  # depth: the draft length
    assert tree(3, 3, 8, 0.6) == ([1, 2, 3, 4], [-1, 0, 0, 0])  # 0.5 unsure, the three 0.95 together
    assert tree(3, 1, 8, 0.6) == ([1], [-1])  # alone, 0.5 is below 0.6: the linear draft's stop
    assert tree(3, 3, 8, 0.9995) == ([], [])  # the sure 0.95 (0.9993 of the table's mass) alone is below


def test_a_trees_size_is_the_callers_else_what_one_pass_verifies():
    assert tree_nodes(7, 4) == 7
    assert tree_nodes(None, 3) == 2 and tree_nodes(None, 4) == 3  # the longest linear draft: pass_rows - 1
    assert tree_nodes(None, None) == 8  # a backend that does not say (the runtime's longest draft)


# a table that repeats its rows with other values: the lookup's matches disagree on the numbers
TABLE = "Write the table again.\n| city | temp |\n| Paris | 21 |\n| Rome | 25 |\n| Paris | 19 |\n| Rome | 23 |\nAgain:\n"


@pytest.mark.slow
def test_tree_speculation_decodes_fulls_tokens_in_fewer_passes(demo, monkeypatch):
    if unavailable("auto"):
        pytest.skip(f"native kernels unavailable: {unavailable('auto')}")
    engine = Engine(demo, backend="native")
    trees = []  # branches of each tree verified
    forward_tree = engine.llm.forward_tree

    def counting(cache, ids, parents):
        trees.append(sum(parent == 0 for parent in parents))
        return forward_tree(cache, ids, parents)

    monkeypatch.setattr(engine.llm, "forward_tree", counting)
    full = engine.session(mode="full", max_new_tokens=60).generate(TABLE)
    linear = engine.session(mode="speculate", light="ngram", max_new_tokens=60).generate(TABLE)
    assert not trees
    # room for the alternatives beside the chain: more than the default one pass's rows
    tree = engine.session(mode="speculate", light="ngram", draft_branches=4, draft_tree_nodes=5,
                          max_new_tokens=60).generate(TABLE)
    assert tree.tokens == linear.tokens == full.tokens
    assert trees and max(trees) >= 2  # trees verified, some branching at their first token
    assert tree.stats.llm_calls < linear.stats.llm_calls < full.stats.llm_calls
    trees.clear()  # sampling verifies trees too (multi-draft rejection: test_tree_walks_sample_as_the_llm_would)
    engine.session(mode="speculate", light="ngram", draft_branches=4, draft_tree_nodes=5, temperature=0.7, seed=1,
                   max_new_tokens=20).generate(TABLE)
    assert trees


DRIVE = "Three tips for staying awake on a long drive:"


def counting_trees(engine, monkeypatch) -> list[int]:
    """The branches at the first draft position of each tree the LLM verifies, as they come."""
    trees = []
    forward_tree = engine.llm.forward_tree

    def counting(cache, ids, parents):
        trees.append(sum(parent == 0 for parent in parents))
        return forward_tree(cache, ids, parents)

    monkeypatch.setattr(engine.llm, "forward_tree", counting)
    return trees


@pytest.mark.slow
@pytest.mark.parametrize("light", ["slm", "ngram+slm"])
@pytest.mark.parametrize("nodes", [None, 8])
def test_slm_trees_decode_fulls_tokens(demo, monkeypatch, light, nodes):
    """The SLM's alternatives (and, with ngram+slm, the lookup's continuations) verified as trees:
    greedy, the same tokens as ``full`` and as linear drafts, on a prompt where the SLM is unsure
    and on one the lookup copies from."""
    if unavailable("auto"):
        pytest.skip(f"native kernels unavailable: {unavailable('auto')}")
    engine = Engine(demo, backend="native")
    trees = counting_trees(engine, monkeypatch)
    passes = {"linear": 0, "tree": 0}
    for prompt in (DRIVE, TABLE):
        full = engine.session(mode="full", max_new_tokens=40).generate(prompt)
        linear = engine.session(mode="speculate", light=light, max_new_tokens=40).generate(prompt)
        trees.clear()
        tree = engine.session(mode="speculate", light=light, draft_branches=3, draft_tree_nodes=nodes,
                              max_new_tokens=40).generate(prompt)
        assert tree.tokens == linear.tokens == full.tokens, (light, prompt)
        assert trees and max(trees) >= 2, (light, prompt)  # trees verified, some branching at their first token
        passes["linear"] += linear.stats.llm_calls
        passes["tree"] += tree.stats.llm_calls
    assert passes["tree"] <= passes["linear"]


@pytest.mark.slow
def test_grammars_keep_linear_drafts_and_sampling_verifies_trees(demo, monkeypatch):
    """A grammar's drafts (its forced tokens between the light path's, a mask per position) stay
    linear chains: the same tokens as ``full`` under it, no tree forward. Sampled speculation
    verifies trees (the walk's exactness: test_tree_walks_sample_as_the_llm_would)."""
    if unavailable("auto"):
        pytest.skip(f"native kernels unavailable: {unavailable('auto')}")
    engine = Engine(demo, backend="native")
    trees = counting_trees(engine, monkeypatch)
    regex = {"type": "regex", "regex": r"Tip 1: [a-z ]{5,40}\. Tip 2: [a-z ]{5,40}\."}
    for light in ("slm", "ngram+slm"):
        full = engine.session(mode="full", response_format=regex, max_new_tokens=40).generate(DRIVE)
        tree = engine.session(mode="speculate", light=light, draft_branches=3, response_format=regex,
                              max_new_tokens=40).generate(DRIVE)
        assert tree.tokens == full.tokens and tree.stats.forced > 0, light
    assert not trees
    sampled = engine.session(mode="speculate", light="slm", draft_branches=3, temperature=0.8, seed=3,
                             max_new_tokens=24).generate(DRIVE)
    assert trees and len(sampled.tokens) == 24


# A tree over a 4-token vocabulary: the root (node 0) has children 2 and 0 (nodes 1, 2); node 1
# has child 1 (node 3), a leaf. Each node's logits are the LLM's next-token logits there.
WALK_IDS, WALK_PARENTS = [3, 2, 0, 1], [-1, 0, 0, 1]


def ancestral(p: np.ndarray) -> dict[tuple[int, ...], float]:
    """The exact distribution of what the walk emits when each token is sampled from the LLM's
    distribution at its node (``p[node]``), one token after leaving the tree or after a leaf."""
    out: dict[tuple[int, ...], float] = {}

    def visit(node: int, prefix: tuple[int, ...], mass: float) -> None:
        for token in range(p.shape[1]):
            child = next((i for i in range(1, 4) if WALK_PARENTS[i] == node and WALK_IDS[i] == token), None)
            if child is None:
                out[(*prefix, token)] = mass * p[node, token]
            else:
                visit(child, (*prefix, token), mass * p[node, token])

    visit(0, (), 1.0)
    return out


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_tree_walks_sample_as_the_llm_would(temperature, top_p):
    """Sampled verification of a tree (each node's children checked by recursive rejection,
    Sampler.verify_candidates) emits token sequences distributed exactly as sampling token by
    token from the LLM: chi-square over 40000 walks against the enumerated distribution (with
    top_p, tokens outside the nucleus never come)."""
    from edgeroute.runtime.decoding import walk_tree
    from edgeroute.runtime.sampling import Sampler

    logits = np.log(np.array([[0.30, 0.05, 0.40, 0.25], [0.10, 0.55, 0.15, 0.20],
                              [0.45, 0.05, 0.20, 0.30], [0.25, 0.25, 0.25, 0.25]]))
    sampler = Sampler(temperature, top_p, seed=7)
    want = ancestral(np.stack([sampler.probabilities(row) for row in logits]))
    counts: dict[tuple[int, ...], int] = {}
    trials = 40000
    for _ in range(trials):
        path, token = walk_tree(sampler, logits, WALK_IDS, WALK_PARENTS)
        emitted = (*(WALK_IDS[node] for node in path[1:]), token)
        counts[emitted] = counts.get(emitted, 0) + 1
    assert set(counts) <= {seq for seq, q in want.items() if q > 0}
    outcomes = [seq for seq, q in want.items() if q > 0]
    chi2 = sum((counts.get(seq, 0) - trials * want[seq]) ** 2 / (trials * want[seq]) for seq in outcomes)
    # the chi-square's 0.001 upper tail (Wilson-Hilferty: z = 3.09; 32.9 for 12 degrees of freedom)
    degrees = len(outcomes) - 1
    tail = degrees * (1 - 2 / (9 * degrees) + 3.09 * (2 / (9 * degrees)) ** 0.5) ** 3
    assert chi2 < tail, (chi2, degrees)
    greedy = walk_tree(Sampler(), logits, WALK_IDS, WALK_PARENTS)
    assert greedy == ([0, 1, 3], 0)  # 2 (the root's argmax: node 1), 1 (node 1's: node 3), then node 3's argmax
