"""`LLMEngine.warm_up`, which a node runs before /health turns 200: it steps the engine
through a prefill and sampled decodes, and leaves nothing behind."""

from __future__ import annotations

from common.wire.sampling_params import SamplingParams


def test_warm_up_leaves_the_engine_as_it_found_it(make_engine) -> None:
    engine = make_engine()
    fresh = make_engine()
    seconds = engine.warm_up()
    assert seconds > 0
    a = engine.allocator
    assert a.num_free == a.num_blocks and a.num_cached == 0 and a.evictions == 0
    assert a.event_no == 0 and engine.scheduler.prefix_queries == 0
    assert engine.prefill_tokens_per_s is None  # a router would plan with it
    assert engine.state()["prefill_tokens_per_s"] is None
    assert not engine.has_work()
    a.check_integrity()
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0.7, seed=9, max_tokens=8, ignore_eos=True)
    assert engine.generate([prompt], params)[0].token_ids == (
        fresh.generate([prompt], params)[0].token_ids
    )
    assert engine.generate([prompt], params)[0].token_ids  # (and caching still works)
