"""`pdserve bench-transfer`'s shapes."""

from __future__ import annotations


def test_bench_tiny_shape_is_the_built_in_models() -> None:
    """bench-transfer's "tiny" shape (written out, kv_transfer imports no model) is the tiny
    model's KV block."""
    from common.engine.config import EngineConfig
    from common.tiny.model import TinyLlamaShape
    from kv_transfer.bench.main import SHAPES

    t, s = TinyLlamaShape(), SHAPES["tiny"]()
    assert (s.layers, s.heads, s.head_dim) == (
        t.num_hidden_layers,
        t.num_key_value_heads,
        t.head_dim,
    )
    assert s.block_size == EngineConfig(model="").block_size
