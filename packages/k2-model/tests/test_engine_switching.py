"""Engine switching (RL colocation): the engine gives its KV pool back while nothing runs and
regrows it on the next request, with the same outputs as an engine that never freed it."""

from __future__ import annotations

import pytest
import torch
from k2_model.engine import Engine, SamplingParams
from k2_model.testing import tiny_model


def _engine(model) -> Engine:
    return Engine(model, max_batch_size=8, seed=0)


def test_free_cache_memory_releases_the_pool_and_outputs_stay_the_same():
    torch.manual_seed(0)
    model = tiny_model().eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32]]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=2)

    switching, plain = _engine(model), _engine(model)
    first = [c.token_ids for c in switching.generate(prompts, params)]
    assert switching.cache.allocated_bytes() > 0 and switching.cache.num_cached() > 0
    freed = switching.free_cache_memory()
    assert freed > 0 and switching.cache.allocated_bytes() == 0 and switching.cache.num_cached() == 0

    again = [c.token_ids for c in switching.generate(prompts, params)]  # the pool regrows
    assert switching.cache.allocated_bytes() > 0
    want = [c.token_ids for c in plain.generate(prompts, params)]
    assert again == first == want
    assert switching.stats.prefilled_tokens == 2 * sum(map(len, prompts))  # nothing cached survived


def test_free_cache_memory_is_refused_while_requests_run():
    torch.manual_seed(0)
    engine = _engine(tiny_model().eval())
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="still queued or running"):
        engine.free_cache_memory()
    engine.step()
    with pytest.raises(RuntimeError, match="still queued or running"):
        engine.free_cache_memory()
