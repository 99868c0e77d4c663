"""Lean storage that stays exact: int4 embedding tables two codes per byte."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from edgeroute.arch import ArchConfig
from edgeroute.export.graphs import build_embed
from edgeroute.export.tensors import BlockQuantWeight

ARCH = ArchConfig(family="qwen2", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=300, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64)


@pytest.mark.parametrize("with_offset", [True, False])
def test_packed_int4_embedding_gathers_exactly_the_dequantized_rows(with_offset):
    rng = np.random.default_rng(0)
    shape = (ARCH.vocab_size, ARCH.hidden_size)
    table = BlockQuantWeight(rng.integers(-8, 8, shape).astype(np.int8),
                             rng.uniform(1e-3, 1e-1, (shape[0], 2)).astype(np.float32), 4, 32,
                             rng.normal(0, 0.05, (shape[0], 2)).astype(np.float32) if with_offset else None, "gguf:Q4_K")
    model = build_embed(ARCH, table)
    packed = [t for t in model.graph.initializer if t.name.endswith("qweight_packed")]
    assert packed and packed[0].dims == [ARCH.vocab_size, ARCH.hidden_size // 2]  # half a byte per code
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([0, 299, 17, 17, 150], np.int64)
    got = session.run(None, {"input_ids": ids})[0]
    np.testing.assert_array_equal(got, table.dequantize()[ids])
