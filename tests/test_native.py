"""The native CPU backend: its kernels against the GGUF block decoders, its model against the
ONNX Runtime model of the same bundle, exact steps, the plan's actions, export and selection."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edgeroute.bundle import NATIVE_FORMATS, Bundle
from edgeroute.errors import BundleError, InputError, NativeBackendUnavailable
from edgeroute.export.gguf_blocks import decode_gguf_tensor
from edgeroute.runtime import Engine
from edgeroute.runtime.backend import resolve_kv_dtype
from edgeroute.runtime.backends.onnxruntime import OrtModel
from edgeroute.runtime.layers import DROP, RUN, SKIP, SKIP_MLP
from edgeroute.runtime.memory import estimate

native = pytest.importorskip("edgeroute.runtime.backends.native")


def unavailable(kernels: str) -> str | None:
    """Why this machine cannot run the kernel set (the library does not load; a CPU without the
    set's instructions; the set is the one "auto" runs here, tested as auto), or None."""
    try:
        native.native_library(kernels)
    except NativeBackendUnavailable as err:
        return str(err)
    if kernels not in ("auto", "generic") and native.native_kernels("auto") == kernels:
        return f"this CPU's own kernels are the {kernels} set (tested as auto)"
    return None


UNAVAILABLE = unavailable("auto")
needs_kernels = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"native kernels unavailable: {UNAVAILABLE}")

# byte offsets of each format's fp16 block factors (d, and m / dmin where the format has one)
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random codes and scales with sane fp16 factors, as a GGUF stores them: [rows, bytes per row]."""
    rng = np.random.default_rng(seed)
    values, block_bytes = NATIVE_FORMATS[fmt]
    raw = rng.integers(0, 256, size=(rows, cols // values, block_bytes), dtype=np.uint8)
    for at in FP16_FIELDS[fmt]:
        factor = (rng.uniform(0.002, 0.02, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])).astype(np.float16)
        raw[:, :, at:at + 2] = factor.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def dequantized(fmt: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return decode_gguf_tensor(raw.reshape(-1), fmt, shape).dequantize()


@needs_kernels
@pytest.mark.parametrize("kernels", ["auto", "avx2", "avx512-vnni", "generic"])
@pytest.mark.parametrize("fmt", native.BLOCK_FORMATS)
def test_kernels_match_the_gguf_decoders(fmt, kernels):
    if unavailable(kernels):
        pytest.skip(f"the {kernels} kernels: {unavailable(kernels)}")
    shape = (37, 512)  # an odd row count: the threads' shares differ
    raw = random_blocks(fmt, *shape)
    weight = dequantized(fmt, raw, shape)
    rows = np.array([0, 17, 36])
    assert np.array_equal(native.native_dequantize(fmt, raw, shape, rows, kernels), weight[rows])
    rng = np.random.default_rng(1)
    # integer activations with a full-scale value in every 32 values quantize exactly (scale 1)
    exact = rng.integers(-127, 128, size=(5, shape[1])).astype(np.float32)
    exact[:, ::32] = 127
    want = exact.astype(np.float64) @ weight.T.astype(np.float64)
    got = native.native_matmul(fmt, raw, shape, exact, kernels=kernels)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # real activations: int8 rounding, a percent or so
    x = rng.standard_normal((9, shape[1])).astype(np.float32)
    want = x @ weight.T
    got = native.native_matmul(fmt, raw, shape, x, kernels=kernels)
    assert np.abs(got - want).max() <= 0.03 * np.abs(want).max()
    # each row's result is the same bits whatever else is in the pass (tiles of 4 rows, remainders)
    for i in (0, 4, 8):
        assert np.array_equal(native.native_matmul(fmt, raw, shape, x[i:i + 1], kernels=kernels)[0], got[i])


@needs_kernels
def test_kernels_refuse_what_they_do_not_take():
    raw = random_blocks("Q4_K", 4, 512)
    with pytest.raises(InputError, match="do not hold"):
        native.native_matmul("Q4_K", raw[:, :-1], (4, 512), np.zeros((1, 512), np.float32))
    with pytest.raises(Exception, match="outside"):
        native.native_dequantize("Q4_K", raw, (4, 512), np.array([4]))
    with pytest.raises(Exception, match="not one of"):
        native.native_matmul("IQ2_XS", raw, (4, 512), np.zeros((1, 512), np.float32))


def cache_rows(x: np.ndarray, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """[kv, positions, hd] floats as native cache rows, and the values those rows hold. An int8
    row: its codes per 32 values at scale max|x| / 127, then the float32 scales' bytes."""
    if kv_dtype != "int8":
        rows = x.astype(kv_dtype)
        return rows, rows.astype(np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scales = (np.abs(blocks).max(-1, keepdims=True) / 127).astype(np.float32)
    codes = np.rint(blocks / np.where(scales == 0, 1, scales)).astype(np.int8)
    rows = np.concatenate([codes.reshape(x.shape), scales.view(np.int8).reshape(*x.shape[:-1], -1)], -1)
    return rows, (codes * scales).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("kernels", ["auto", "avx2", "avx512-vnni", "generic"])
@pytest.mark.parametrize("kv_dtype,head_dim", [("float32", 8), ("float32", 24), ("float16", 72), ("float32", 136),
                                               ("float16", 64), ("int8", 32), ("int8", 96), ("int8", 128)])
def test_attention_kernels_match_a_softmax_over_the_cache(kernels, kv_dtype, head_dim):
    """Every head_dim the kernels take (a multiple of 8; of 32 for int8), whole and partial vectors
    on each kernel set, over more than one 256-position segment, causal rows, dropped positions."""
    if unavailable(kernels):
        pytest.skip(f"the {kernels} kernels: {unavailable(kernels)}")
    rng = np.random.default_rng(head_dim)
    heads, kv_heads, capacity, start, m = 6, 2, 640, 597, 3
    rows, held = {}, {}
    for name in ("keys", "values"):
        x = rng.standard_normal((kv_heads, capacity, head_dim)).astype(np.float32)
        rows[name], held[name] = cache_rows(x, kv_dtype)
    q = rng.standard_normal((m, heads, head_dim)).astype(np.float32)
    # an int8 cache's scores are the query's quantized like the rows (per 32 values)
    q_held = cache_rows(q, kv_dtype)[1] if kv_dtype == "int8" else q
    masked = np.zeros(capacity, bool)
    masked[100:180] = True
    got = native.native_attention(q, rows["keys"], rows["values"], start, kv_dtype, masked, kernels=kernels)
    group = heads // kv_heads
    for i in range(m):
        seen = ~masked[:start + i + 1]
        for h in range(heads):
            k, v = held["keys"][h // group, :start + i + 1][seen], held["values"][h // group, :start + i + 1][seen]
            scores = k.astype(np.float64) @ q_held[i, h] / np.sqrt(head_dim)
            p = np.exp(scores - scores.max())
            np.testing.assert_allclose(got[i, h], p @ v / p.sum(), rtol=2e-4, atol=2e-5)


@needs_kernels
def test_attention_kernels_refuse_shapes_they_do_not_take():
    keys = np.zeros((1, 16, 40), np.int8)  # an int8 row of head_dim 36 would need 36 % 32 == 0
    with pytest.raises(InputError, match="not int8 cache rows"):
        native.native_attention(np.zeros((1, 1, 36), np.float32), keys, keys, 0, "int8")
    keys = np.zeros((1, 16, 8), np.float32)
    with pytest.raises(InputError, match="shapes the kernels do not take"):
        native.native_attention(np.zeros((1, 1, 8), np.float32), keys, keys, 16, "float32")  # past the capacity


@pytest.fixture(scope="module")
def demo(smollm2_bundles):
    return Bundle.open(smollm2_bundles["int4"][0])


@pytest.fixture(scope="module", params=["auto", "avx2", "generic"])
def models(demo, request):
    """The native model on this CPU's kernels, on the AVX2 ones (where this CPU has AVX-512) and
    on the generic ones (what Arm CPUs run), and the ONNX Runtime model of the same bundle."""
    if unavailable(request.param):
        pytest.skip(f"the {request.param} kernels: {unavailable(request.param)}")
    return native.NativeModel(demo, kv_dtype="float32", kernels=request.param), OrtModel(demo)


def alike(model, bundle: Bundle, kv_dtype: str):
    """A native model on the same kernel set as ``model``, with a ``kv_dtype`` cache."""
    kernels = model.kernels if model.kernels in ("generic", "avx2") else "auto"
    return native.NativeModel(bundle, kv_dtype=kv_dtype, kernels=kernels)


@pytest.fixture(scope="module")
def text_ids(demo):
    from tokenizers import Tokenizer

    from edgeroute.texts import evaluation_text

    return np.array(Tokenizer.from_file(str(demo.file("tokenizer.json"))).encode(evaluation_text()).ids[:160])


@pytest.mark.slow
def test_export_writes_the_gguf_blocks_for_both_models(demo):
    for entry in demo.models.values():
        assert entry.native is not None
        tensors = entry.native.tensors
        assert len(tensors) == 1 + entry.num_layers * 9 + 1  # embedding, 2 norms + 7 matrices per layer, final norm
        assert tensors["blk.0.ffn_up.weight"].format == "Q4_1" and tensors["token_embd.weight"].format == "Q8_0"
    assert "output.weight" not in demo.llm.native.tensors  # SmolLM2's head is the tied embedding


@pytest.mark.slow
def test_a_requantized_export_has_no_native_weights(smollm2_bundles):
    """An fp32 export of the GGUF computes in float: the blocks as stored would be another model."""
    path, report = smollm2_bundles["fp32"]
    assert Bundle.open(path).llm.native is None
    assert any("re-quantizes" in note for note in report.notes)
    assert Engine(path).llm.flavour == "portable"


@needs_kernels
@pytest.mark.slow
def test_inspect_names_the_kernels_the_native_weights_run_on_here(smollm2_bundles):
    from typer.testing import CliRunner

    from edgeroute.cli import app

    shown = CliRunner().invoke(app, ["inspect", str(smollm2_bundles["int4"][0]), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["native_here"] == f"the {native.native_kernels()} kernels"
    without = CliRunner().invoke(app, ["inspect", str(smollm2_bundles["fp32"][0]), "--json"])
    assert "native_here" not in json.loads(without.output)  # nothing native to run


def assert_same_clear_choices(got: np.ndarray, want: np.ndarray, lead: float = 0.5) -> None:
    """Same top-1 wherever ``want``'s leads its runner-up by more than ``lead``, and on >= 90%
    of all positions."""
    best = np.sort(want, axis=1)
    clear = best[:, -1] - best[:, -2] > lead
    same = got.argmax(1) == want.argmax(1)
    assert clear.mean() > 0.5 and same[clear].all() and same.mean() >= 0.9


@pytest.mark.slow
def test_native_model_agrees_with_onnx_runtime(models, text_ids):
    fast, reference = models
    got = fast.forward(fast.new_cache(), text_ids, all_logits=True)
    want = reference.forward(reference.new_cache(), text_ids, all_logits=True)
    assert got.shape == want.shape
    # both carry the same blocks over; they round activations differently (int8 per 32 or 256
    # values here, ONNX Runtime's own blocking) and ONNX Runtime's head is int8, which flips
    # near-ties (attention's summation order alone moves 6-10 of these 160), never a clear choice
    assert_same_clear_choices(got, want)
    # and predict the text as well as the ONNX Runtime model does
    hits = (got[:-1].argmax(1) == text_ids[1:]).mean()
    assert hits >= (want[:-1].argmax(1) == text_ids[1:]).mean() - 0.03


@pytest.mark.slow
def test_long_context_attention_over_segments_with_a_dropped_one(demo, models):
    """Over 256 positions attention runs per segment and merges them; layer 3 drops positions
    250..519, so one whole segment (256..511) has nothing to attend to in that layer."""
    from tokenizers import Tokenizer

    from edgeroute.texts import evaluation_text

    ids = np.array(Tokenizer.from_file(str(demo.file("tokenizer.json"))).encode(evaluation_text()).ids[:640])
    drop_layer_3 = lambda layer, hidden: DROP if layer == 3 else RUN  # noqa: E731
    logits = []
    for model in models:
        cache = model.new_cache()
        model.forward(cache, ids[:250])
        model.forward(cache, ids[250:520], drop_layer_3)
        assert cache.dropped[3, 250:520].all() and not cache.dropped[3, :250].any()
        logits.append(model.forward(cache, ids[520:], all_logits=True))
    assert_same_clear_choices(*logits)


@pytest.mark.slow
def test_steps_equal_a_multi_token_pass_bit_for_bit(models, text_ids):
    fast = models[0]
    stepped, passed = fast.new_cache(), fast.new_cache()
    fast.forward(stepped, text_ids[:40])
    fast.forward(passed, text_ids[:40])
    steps = np.stack([fast.forward(stepped, text_ids[40 + i:41 + i]) for i in range(6)])
    assert np.array_equal(steps, fast.forward(passed, text_ids[40:46], all_logits=True))
    assert np.array_equal(stepped.keys[:, :, :, :46], passed.keys[:, :, :, :46])


@pytest.mark.slow
def test_plan_actions(models, text_ids):
    fast = models[0]
    prefix, token = text_ids[:20], text_ids[20:21]
    caches = {}
    for name, action in (("run", RUN), ("skip", SKIP), ("skip_mlp", SKIP_MLP), ("drop", DROP)):
        cache = fast.new_cache()
        fast.forward(cache, prefix)
        hidden = fast.hidden_states(cache, token, lambda layer, h, action=action: action if layer == 3 else RUN)
        caches[name] = (cache, hidden)
    run, skip, skip_mlp, drop = (caches[k] for k in ("run", "skip", "skip_mlp", "drop"))
    # layer 3's K/V of the token come from its input hidden state: the same rows whether it ran or not
    assert np.array_equal(run[0].keys[3, :, :, 20], skip[0].keys[3, :, :, 20])
    assert np.array_equal(run[0].keys[3, :, :, 20], skip_mlp[0].keys[3, :, :, 20])
    # later layers see another input, so another output
    assert not np.array_equal(run[1], skip[1]) and not np.array_equal(run[1], skip_mlp[1])
    assert not np.array_equal(skip[1], skip_mlp[1])
    # a dropped layer writes nothing and masks the token's position for later tokens
    assert drop[0].dropped is not None and drop[0].dropped[3, 20] and not drop[0].dropped[3, :20].any()
    assert not drop[0].keys[3, :, :, 20].any()
    after_drop = fast.forward(drop[0], text_ids[21:22])
    assert np.isfinite(after_drop).all()


@pytest.mark.slow
def test_caches_truncate_and_copy(models, text_ids):
    fast = models[0]
    a = fast.new_cache()
    first = fast.forward(a, text_ids[:30])
    fast.forward(a, text_ids[30:35])
    a.truncate(30)
    b = fast.new_cache()
    b.copy_from(a, 30)
    assert np.array_equal(fast.forward(a, text_ids[30:31]), fast.forward(b, text_ids[30:31]))
    with pytest.raises(Exception, match="own caches"):
        fast.forward(OrtModel.new_cache(models[1]), text_ids[:2])
    assert np.isfinite(first).all()


@pytest.mark.slow
def test_engine_picks_native_and_speculation_reproduces_full_without_exact_steps(demo):
    if UNAVAILABLE is not None:
        pytest.skip(f"native kernels unavailable: {UNAVAILABLE}")
    if native.native_kernels() == "generic":  # auto keeps ONNX Runtime there by design (test below)
        pytest.skip("only the generic kernels run here: auto picks ONNX Runtime")
    engine = Engine(demo)
    assert engine.llm.flavour == "native" and engine.slm.flavour == "native" and engine.backend_notes == {}
    prompt = "List three things to check before a long drive."
    full = engine.session(mode="full", max_new_tokens=40).generate(prompt)
    for light in ("slm", "ngram"):
        spec = engine.session(mode="speculate", light=light, max_new_tokens=40).generate(prompt)
        assert spec.tokens == full.tokens, light
    ort = Engine(demo, backend="onnxruntime")
    assert ort.llm.flavour == "portable"


def test_head_rows_give_the_head_columns_of_their_tokens(models):
    model, _ = models
    hidden = np.random.default_rng(3).standard_normal((3, model.arch.hidden_size)).astype(np.float32)
    full = model.head(hidden)
    ids = np.r_[np.arange(40) * 997 % model.arch.vocab_size, model.arch.vocab_size - 1]  # two packed groups and more
    rows = model.head_rows(ids)
    assert len(rows) == ids.size
    np.testing.assert_allclose(rows.logits(hidden), full[:, ids], rtol=0, atol=1e-5 * np.abs(full).max())
    for bad in ([], [model.arch.vocab_size], [-1]):
        with pytest.raises(InputError, match="token ids"):
            model.head_rows(bad)
    rows.close()
    with pytest.raises(InputError, match="closed"):
        rows.logits(hidden)


def test_head_rows_outlive_their_models_handle(demo):
    model = native.NativeModel(demo, kernels="generic", threads=1)
    hidden = np.ones((1, model.arch.hidden_size), np.float32)
    want = model.head(hidden)[:, [5, 9]]
    rows = model.head_rows([5, 9])
    model.close()
    assert np.array_equal(rows.logits(hidden), want)


def test_head_rows_keep_one_copy_of_their_rows_resident(demo):
    if native.native_kernels() not in ("avx2", "avx512-vnni"):
        pytest.skip(f"the {native.native_kernels()} kernels read rows as stored: nothing is packed or given back")

    def resident() -> int:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024

    model = native.NativeModel(demo, "slm", threads=1)
    head = demo.models["slm"].native.tensors.get("output.weight") or demo.models["slm"].native.tensors["token_embd.weight"]
    count = model.arch.vocab_size // 2
    row_bytes = head.bytes // head.shape[0]
    before = resident()
    rows = model.head_rows(np.arange(count))
    # the packed rows only: the gathered copy's packed pages and the file's pages read go back
    assert resident() - before < 1.15 * count * row_bytes + (4 << 20)
    rows.close()


def test_a_draft_vocabulary_scores_its_common_ids_and_the_sequences_and_no_other_token(demo):
    from edgeroute.runtime.drafters import DraftVocabulary, common_ids

    model = native.NativeModel(demo, "slm", kernels="generic", threads=1)
    vocab = model.arch.vocab_size
    vocabulary = DraftVocabulary(model, common_ids(vocab, 64, [vocab - 1, vocab + 5]))  # an added id past it: dropped
    assert vocabulary.common.ids.tolist() == [*range(64), vocab - 1]
    assert vocabulary.sequence_rows([1, 2, 63]) is None  # all common
    rows = vocabulary.sequence_rows([5, 300, 4000, 300])
    assert rows.ids.tolist() == [300, 4000] and vocabulary.sequence_rows([5, 300], rows) is rows
    grown = vocabulary.sequence_rows([5, 300, 4000, 300, 9000], rows)
    assert grown.ids.tolist() == [300, 4000, 9000]
    hidden = np.random.default_rng(4).standard_normal((2, model.arch.hidden_size)).astype(np.float32)
    full, logits = model.head(hidden), vocabulary.logits(hidden, grown)
    kept = [*range(64), vocab - 1, 300, 4000, 9000]
    np.testing.assert_allclose(logits[:, kept], full[:, kept], rtol=0, atol=1e-5 * np.abs(full).max())
    assert np.isneginf(np.delete(logits, kept, axis=1)).all()


def test_the_slm_drafter_scores_the_ids_of_every_sequence_it_is_asked_about_and_reads_its_whole_head_without_a_vocabulary(
        demo):
    from edgeroute.runtime.drafters import DraftVocabulary, SlmDrafter, common_ids

    model = native.NativeModel(demo, "slm", kernels="generic", threads=1)
    vocabulary = DraftVocabulary(model, common_ids(model.arch.vocab_size, 64, []))
    drafter = SlmDrafter(model)
    drafter.vocabulary = vocabulary

    def scored(tokens):
        return set(np.flatnonzero(np.isfinite(drafter.next_logits(tokens))).tolist())

    prompt = [5, 300, 4000]
    assert scored(prompt) == {*range(64), 300, 4000}
    assert scored([*prompt, 7, 9000]) == {*range(64), 300, 4000, 9000}  # the new tokens' ids join
    # a rejected draft: the drafter goes back to the prompt and on with the LLM's token
    assert scored([*prompt, 7, 12000]) >= {*range(64), 300, 4000, 12000}
    drafter.reset()
    assert scored([7, 5000]) == {*range(64), 5000}  # another sequence: the earlier ids go
    drafter.vocabulary = None  # routing, the SLM alone: the whole head
    np.testing.assert_allclose(drafter.next_logits([7, 5000]),
                               model.head(drafter.last_hidden[None])[0], rtol=0, atol=1e-6)
    drafter.reset()
    vocabulary.close()


def test_a_speculating_slm_drafts_from_its_common_rows_and_the_sequences_tokens_and_keeps_fulls_output(
        demo, monkeypatch):
    from edgeroute.runtime.drafters import SlmDrafter

    engine = Engine(demo, backend="native")
    prompt = "Send a message to Marguerite Okonkwo at 221B Baker Street: the parcel arrives on Thursday."
    full = engine.generate(prompt, mode="full", max_new_tokens=32)
    drafts = []
    propose = SlmDrafter.propose

    def recorded(self, tokens, k, min_confidence=0.0):
        proposal = propose(self, tokens, k, min_confidence)
        drafts.append((list(tokens), self.vocabulary, proposal.tokens))
        return proposal

    monkeypatch.setattr(SlmDrafter, "propose", recorded)
    rows = 256  # bytes and the commonest merges: most words are outside them
    got = engine.generate(prompt, mode="speculate", light="slm", draft_rows=rows, max_new_tokens=32)
    assert got.tokens == full.tokens
    vocabulary = engine.draft_vocabulary(rows)
    common = set(vocabulary.common.ids.tolist())
    assert drafts and all(v is vocabulary for _, v, _ in drafts)
    for tokens, _, drafted in drafts:
        for token in drafted:  # each from the common rows, or a token of the sequence before it
            assert token in common or token in tokens, token
            tokens.append(token)
    drafts.clear()
    engine.generate(prompt, mode="speculate", light="slm", draft_rows=0, max_new_tokens=8)
    engine.generate(prompt, mode="route", light="slm", max_new_tokens=8)
    assert drafts and all(v is None for _, v, _ in drafts)  # the whole head: asked for, or routing
    engine.generate(prompt, mode="speculate", light="ngram", draft_rows=128, max_new_tokens=4)
    assert 128 not in engine._draft_vocabularies  # the lookup alone copies no rows
    assert engine.draft_vocabulary(0) is None and engine.draft_vocabulary(engine.slm.arch.vocab_size) is None


def test_draft_rows_is_a_whole_number_and_onnx_runtime_slms_read_their_whole_head(tiny_engine):
    for bad in (-1, 2.5, True):
        with pytest.raises(InputError, match="draft_rows"):
            tiny_engine.generate("hi", mode="speculate", light="slm", draft_rows=bad)
    assert tiny_engine.slm.kernels is None and tiny_engine.draft_vocabulary(16) is None


# the sets' activation rows per pass over the weights (PACK_TILE where they pack, else TILE)
PASS_ROWS = {"avx2": 4, "avx512-vnni": 3, "neon": 4, "dotprod": 4, "i8mm": 4, "generic": 4}


@pytest.mark.slow
def test_drafts_grow_to_one_verification_pass_unless_the_caller_sets_longer(demo, monkeypatch):
    if UNAVAILABLE is not None:
        pytest.skip(f"native kernels unavailable: {UNAVAILABLE}")
    engine = Engine(demo, backend="native")
    assert engine.llm.pass_rows == PASS_ROWS[engine.llm.kernels]
    verified = []  # rows each LLM pass returned logits for: the draft and the token before it
    forward = engine.llm.forward

    def counting(cache, ids, plan=None, all_logits=False, tail=None):
        verified.append(tail or 1)
        return forward(cache, ids, plan=plan, all_logits=all_logits, tail=tail)

    monkeypatch.setattr(engine.llm, "forward", counting)
    prompt = "List three things to check before a long drive."
    full = engine.session(mode="full", max_new_tokens=48).generate(prompt)
    verified.clear()
    fitted = engine.session(mode="speculate", light="slm", max_new_tokens=48).generate(prompt)
    assert fitted.tokens == full.tokens and fitted.stats.accepted > 0
    assert max(verified) == engine.llm.pass_rows  # drafts grew to the pass, never past it
    verified.clear()
    longer = engine.session(mode="speculate", light="slm", max_new_tokens=48, max_draft_tokens=8).generate(prompt)
    assert longer.tokens == full.tokens and max(verified) > engine.llm.pass_rows


@pytest.mark.slow
def test_the_pass_bench_times_passes_of_1_to_9_tokens_on_the_kernels_run(demo, tmp_path):
    if UNAVAILABLE is not None:
        pytest.skip(f"native kernels unavailable: {UNAVAILABLE}")
    out = tmp_path / "passes.json"
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(repo / "tools" / "bench_passes.py"), str(demo.path), "--threads", "1",
                           "--repeats", "1", "--out", str(out)], capture_output=True, text=True, cwd=repo)
    assert done.returncode == 0, done.stderr[-3000:]
    [record] = json.loads(out.read_text())
    assert record["threads"] == 1 and record["pass_rows"] == PASS_ROWS[record["kernels_run"]]
    assert record["longest_default_draft"] == record["pass_rows"] - 1
    assert len(record["pass_ms"]) == 9 and min(record["pass_ms"]) > 0 and record["slm_step_ms"] > 0
    assert out.with_suffix(".png").stat().st_size > 0 and "M=9" in done.stdout


@pytest.mark.slow
def test_settings_only_onnx_runtime_has_choose_it(demo):
    if UNAVAILABLE is not None:
        pytest.skip(f"native kernels unavailable: {UNAVAILABLE}")
    engine = Engine(demo, activations="fp32")
    assert engine.llm.flavour == "portable" and "activations='fp32'" in engine.backend_notes["llm"]
    with pytest.raises(NativeBackendUnavailable, match="attention='gqa'"):
        Engine(demo, attention="gqa", backend="native")
    with pytest.raises(Exception, match="not one of"):
        Engine(demo, backend="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_a_narrow_cache_keeps_the_float32_choices_and_exact_steps(demo, models, text_ids, kv_dtype):
    """Fewer bytes read per position (fp16: half; int8: codes per 32 values and their scales);
    K/V rounded on write, computed in float32."""
    full = models[0]
    narrow = alike(full, demo, kv_dtype)
    cache = narrow.new_cache()
    assert cache.dtype == kv_dtype
    got = narrow.forward(cache, text_ids, all_logits=True)
    assert_same_clear_choices(got, full.forward(full.new_cache(), text_ids, all_logits=True))
    stepped, passed = narrow.new_cache(), narrow.new_cache()
    for c in (stepped, passed):
        narrow.forward(c, text_ids[:40])
    steps = np.stack([narrow.forward(stepped, text_ids[40 + i:41 + i]) for i in range(6)])
    assert np.array_equal(steps, narrow.forward(passed, text_ids[40:46], all_logits=True))
    with pytest.raises(InputError, match=f"heads-first {kv_dtype}"):
        narrow.forward(full.new_cache(), text_ids[:2])
    engine = Engine(demo, kv_dtype=kv_dtype, backend="native")
    assert engine.llm.flavour == "native" and engine.llm.kv_dtype == kv_dtype
    prompt = "List three things to check before a long drive."
    full_run = engine.session(mode="full", max_new_tokens=32).generate(prompt)
    assert engine.session(mode="speculate", max_new_tokens=32).generate(prompt).tokens == full_run.tokens


def anonymous_resident_bytes() -> int:
    """RssAnon: memory the process wrote (the weight file's mapped pages do not count)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@needs_kernels
def test_the_working_memory_is_allocated_at_load_for_the_longest_pass(demo, text_ids):
    """A long prompt or a context policy's re-prefill mid-conversation takes no new memory: the
    library writes the working memory of a PREFILL_CHUNK-row pass at the full capacity at load
    (~13 MiB for SmolLM2), and the cache at its creation."""
    from edgeroute.runtime.memory import PREFILL_CHUNK

    model = native.NativeModel(demo)
    cache = model.new_cache()
    model.forward(cache, text_ids[:8])
    before = anonymous_resident_bytes()
    model.forward(cache, np.tile(text_ids, 3)[:PREFILL_CHUNK + 40])
    assert anonymous_resident_bytes() - before < 4 << 20


@needs_kernels
def test_the_default_cache_is_the_narrowest_that_holds_on_the_kernels_that_run(demo):
    """kv_dtype='auto', the default: int8 on the AVX-512 VNNI kernels, fp16 on the other native
    ones (their answers differ from the fp32 cache's as much as fp32's own do between kernel
    sets: README), fp32 where ONNX Runtime's graphs run; the fit check counts the cache it will be."""
    kernels = native.native_kernels()
    default = Engine(demo, slm=False)
    if kernels == "generic":  # auto runs ONNX Runtime there (EDGEROUTE_KERNELS=generic, or a CPU without a set)
        assert (default.llm.flavour, default.llm.kv_dtype) == ("portable", "float32")
        return
    expected = "int8" if kernels == "avx512-vnni" else "float16"
    assert (default.llm.flavour, default.llm.kv_dtype) == ("native", expected)
    assert Engine(demo, slm=False, backend="onnxruntime").llm.kv_dtype == "float32"
    assert Engine(demo, slm=False, kv_dtype="float32").llm.kv_dtype == "float32"
    need = estimate(demo, default.context_length, expected, slm=False)
    Engine(demo, slm=False, memory_budget=need.total)
    with pytest.raises(InputError, match=f"more than the memory budget .*kv_dtype='{expected}'"):
        Engine(demo, slm=False, memory_budget=need.total, backend="onnxruntime")
    with pytest.raises(InputError, match="'bfloat16' is not one of auto, float32, float16, int8"):
        Engine(demo, kv_dtype="bfloat16")


def test_auto_takes_int8_only_on_the_vnni_kernels_and_a_head_dim_of_32s(monkeypatch):
    def entry(head_dim: int):
        return SimpleNamespace(arch=SimpleNamespace(head_dim=head_dim), target=SimpleNamespace(kv_dtypes=("float32", "float16")))

    for kernels, head_dim, want in (("avx512-vnni", 64, "int8"), ("avx512-vnni", 40, "float16"),
                                    ("avx2", 64, "float16"), ("generic", 128, "float16")):
        monkeypatch.setattr(native, "native_kernels", lambda requested="auto", kernels=kernels: kernels)
        assert resolve_kv_dtype("auto", "native", entry(head_dim)) == want
        assert resolve_kv_dtype("auto", "onnxruntime", entry(head_dim)) == "float32"
        assert resolve_kv_dtype("float32", "native", entry(head_dim)) == "float32"


@pytest.mark.slow
def test_an_int8_cache_row_holds_codes_then_their_per_32_scales(demo, models, text_ids):
    """Values as they are; keys divided by their channel's scale (the queries are multiplied by
    it), a channel's peak over the calibration text, floored at a tenth of its head's mean."""
    full = models[0]
    narrow = alike(full, demo, "int8")
    wide_cache, cache = full.new_cache(), narrow.new_cache()
    full.forward(wide_cache, text_ids[:40])
    narrow.forward(cache, text_ids[:40])
    a, hd = demo.llm.arch, demo.llm.arch.head_dim
    assert cache.keys.shape[-1] == hd + hd // 32 * 4 and cache.keys.nbytes * 32 == wide_cache.keys.nbytes * 9
    key_scales = narrow.key_scales
    assert key_scales.shape == (a.num_layers, a.num_kv_heads, hd) and np.isfinite(key_scales).all()
    assert (key_scales >= 0.1 * key_scales.mean(-1, keepdims=True) * (1 - 1e-6)).all()
    assert key_scales.max() / key_scales.min() > 4  # the channels differ: this is not a no-op
    assert full.key_scales is None  # only an int8 cache divides its keys
    for wide, rows, divisor in ((wide_cache.keys, cache.keys, key_scales[0][:, None, :]),
                                (wide_cache.values, cache.values, 1.0)):
        want = (wide[0, 0, :, :40] / divisor).reshape(-1, hd // 32, 32)  # layer 0: from the same embeddings
        codes = rows[0, 0, :, :40, :hd].reshape(want.shape).astype(np.float32)
        scales = np.ascontiguousarray(rows[0, 0, :, :40, hd:]).view(np.float32).reshape(*want.shape[:2], 1)
        np.testing.assert_allclose(scales, np.abs(want).max(-1, keepdims=True) / 127, rtol=1e-6)
        assert (np.abs(codes * scales - want) <= scales * 0.5 * (1 + 1e-5)).all()
        assert np.abs(codes).max() == 127


@needs_kernels
def test_an_int8_cache_measures_its_key_scales_once_and_keeps_them(demo, tmp_path, monkeypatch):
    """The load's pass over the calibration text runs once per weights, tokenizer and kernels;
    a damaged kept file is measured again, and a cache directory that cannot be written costs
    the pass each time, not the load."""
    monkeypatch.setenv("EDGEROUTE_CACHE", str(tmp_path))
    native.native_library()  # built or found before the cache directory moved: kept per process
    first = native.NativeModel(demo, kv_dtype="int8")
    kept = list((tmp_path / "key-scales").glob("*.npy"))
    assert len(kept) == 1

    def measured(scales):
        monkeypatch.setattr(native.NativeModel, "_key_channel_peaks", lambda self, bundle: scales)

    measured(None)  # a second measurement would fail the load
    np.testing.assert_array_equal(native.NativeModel(demo, kv_dtype="int8").key_scales, first.key_scales)
    kept[0].write_bytes(b"half a file")
    measured(first.key_scales * 2)
    np.testing.assert_array_equal(native.NativeModel(demo, kv_dtype="int8").key_scales, first.key_scales * 2)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("EDGEROUTE_CACHE", str(blocked))  # key-scales/ cannot be made under a file
    np.testing.assert_array_equal(native.NativeModel(demo, kv_dtype="int8").key_scales, first.key_scales * 2)


@pytest.mark.slow
def test_auto_keeps_onnx_runtime_where_only_the_generic_kernels_run(demo, monkeypatch):
    if UNAVAILABLE is not None:
        pytest.skip(f"native kernels unavailable: {UNAVAILABLE}")
    monkeypatch.setattr(native, "native_kernels", lambda kernels="auto": "generic")
    engine = Engine(demo, slm=False)
    assert engine.llm.flavour == "portable" and "backend='native' opts in" in engine.backend_notes["llm"]
    assert Engine(demo, slm=False, backend="native").llm.flavour == "native"


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["neon", "dotprod"])
def test_auto_takes_the_native_backend_where_arm_kernels_run(demo, monkeypatch, arm):
    """On aarch64 the library's best kernels are an Arm set (held to the generic ones under qemu
    by tests/test_c_library.py): auto runs them, as it runs the x86 sets."""
    if UNAVAILABLE is not None:
        pytest.skip(f"native kernels unavailable: {UNAVAILABLE}")
    monkeypatch.setattr(native, "native_kernels", lambda kernels="auto": arm)
    engine = Engine(demo, slm=False)
    assert engine.llm.flavour == "native" and engine.backend_notes.get("llm") is None


def test_kernels_that_do_not_load_leave_auto_on_onnx_runtime_with_its_cache(demo, monkeypatch):
    def no_library(kernels="auto"):
        raise NativeBackendUnavailable("no C compiler (cc or gcc, or $CC) to build the native kernels")

    monkeypatch.setattr(native, "native_kernels", no_library)
    engine = Engine(demo, slm=False)
    assert (engine.llm.flavour, engine.llm.kv_dtype) == ("portable", "float32")
    assert "no C compiler" in engine.backend_notes["llm"]
    with pytest.raises(NativeBackendUnavailable, match="backend='native' cannot run here: no C compiler"):
        Engine(demo, slm=False, backend="native", memory_budget=1 << 40)  # the fit check asks first


def test_a_bundle_without_native_weights_runs_on_onnx_runtime(tiny_slm_bundle):
    engine = Engine(tiny_slm_bundle)
    assert engine.llm.flavour == "portable" and "no native weights" in engine.backend_notes["llm"]
    with pytest.raises(NativeBackendUnavailable, match="no native weights"):
        Engine(tiny_slm_bundle, backend="native")


@pytest.mark.slow
def test_a_damaged_native_section_is_refused(demo, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(demo.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"]["llm"]["native"]["tensors"]["blk.0.ffn_up.weight"]["offset"] = 1 << 40
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="outside its file"):
        Bundle.open(copy, verify=False)


def test_a_library_that_does_not_load_or_does_not_match_is_a_clear_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setenv("EDGEROUTE_NATIVE_LIB", str(tmp_path / "libedgeroute.so"))
    with pytest.raises(NativeBackendUnavailable, match="does not load from .*EDGEROUTE_NATIVE_LIB"):
        native.native_library()
    with pytest.raises(NativeBackendUnavailable, match="does not load"):  # kept: no second try
        native.native_kernels()
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "header_constants", lambda: {"ER_ABI_VERSION": 1})
    monkeypatch.delenv("EDGEROUTE_NATIVE_LIB")
    with pytest.raises(NativeBackendUnavailable, match=r"ABI \d+, this edgeroute drives ABI 1"):
        native.native_library()
    monkeypatch.setattr(native, "_library", None)
    with pytest.raises(InputError, match="not one of"):
        native.native_library("sve")


@needs_kernels
def test_kernels_this_cpu_lacks_are_refused_naming_what_it_runs():
    lib = native.native_library()
    for kernels in ("avx2", "avx512-vnni", "neon", "dotprod", "i8mm"):
        if not lib.er_kernels_supported(native.kernel_id(kernels)):
            with pytest.raises(NativeBackendUnavailable, match=f"the {kernels} kernels do not run on this CPU"):
                native.native_library(kernels)
    assert native.native_kernels("generic") == "generic"
    best = native.native_kernels()
    for family, members in native.FAMILIES.items():  # "x86" / "arm": the best set of that family, or refused
        if best in members:
            assert native.native_kernels(family) == best
        else:
            with pytest.raises(NativeBackendUnavailable, match=f"the {family} kernels need .*runs the {best} kernels"):
                native.native_library(family)


@pytest.mark.slow
def test_the_native_weight_file_is_a_gguf_that_gguf_tools_read(demo):
    """The library reads the tensor table from the file itself; gguf-py (what llama.cpp's tools
    use) reads the same file, names and shapes as the manifest lists them."""
    gguf = pytest.importorskip("gguf")
    entry = demo.llm
    reader = gguf.GGUFReader(demo.file(entry.native.file))
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(entry.native.tensors)
    for name, listed in entry.native.tensors.items():
        assert tuple(int(d) for d in reversed(tensors[name].shape)) == listed.shape
        assert int(tensors[name].data_offset) == listed.offset
    assert int(reader.fields["edgeroute.layers"].parts[-1][0]) == entry.arch.num_layers


@pytest.mark.slow
def test_native_weights_without_the_gguf_container_are_refused_with_the_fix(demo, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(demo.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["models"]["llm"]["native"]["container"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(NativeBackendUnavailable, match="predate the GGUF container.*re-export"):
        native.NativeModel(Bundle.open(copy, verify=False))


@pytest.mark.slow
def test_a_device_profiles_gpu_providers_this_onnx_runtime_lacks_leave_auto_on_the_native_backend(demo, monkeypatch):
    """A Jetson module's profile names TensorRT's and CUDA's providers for onnxruntime-gpu; where
    this ONNX Runtime lacks them it would run the graphs on its CPU provider, so auto runs the
    native kernels; where it has one, auto runs ONNX Runtime and says why."""
    if UNAVAILABLE is not None:
        pytest.skip(f"native kernels unavailable: {UNAVAILABLE}")
    from edgeroute.runtime import backend
    from edgeroute.runtime.options import EngineOptions

    monkeypatch.setattr(backend.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    engine = Engine(demo, slm=False, profile="jetson-orin-nano-8gb")
    assert engine.llm.flavour == "native" and engine.backend_notes.get("llm") is None
    entry = demo.models["llm"]
    monkeypatch.setattr(backend.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    chosen, why = backend.backend_for(entry, EngineOptions(providers=engine.settings.providers))
    assert chosen == "onnxruntime" and "['CUDAExecutionProvider'] run the graphs through ONNX Runtime" in why
    assert backend.backend_for(entry, EngineOptions(providers=(("CPUExecutionProvider", {}),)))[0] == "native"
