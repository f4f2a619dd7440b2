"""`k2 ckpt bench --size-mb S` moves S MiB in all, whatever the bucket size (it once moved 96 MiB
for --size-mb 64: each rank's bucket-spanning tensor was 1.5 buckets even when its share was less)."""

from __future__ import annotations

import pytest
from k2_ckpt.bench import BenchConfig, _spec, spec_nbytes


@pytest.mark.parametrize(
    ("size_mb", "ranks", "bucket_mb"), [(64, 2, 32), (256, 2, 32), (16, 4, 8), (1, 1, 32)]
)
def test_spec_totals_the_requested_size(size_mb, ranks, bucket_mb):
    cfg = BenchConfig(ranks=ranks, size_mb=size_mb, bucket_mb=bucket_mb)
    spec = _spec(cfg)
    total = sum(spec_nbytes(spec, r) for r in range(ranks))
    # each tensor's rows are whole 1024-column rows: at most one row (4 KiB) short per tensor
    assert size_mb * 2**20 - 4096 * len(spec) <= total <= size_mb * 2**20
    if size_mb * 2**20 / ranks > 1.5 * bucket_mb * 2**20:  # a tensor spanning buckets is still there
        assert max(sh[0] * sh[1] * 4 for dt, sh in spec.values() if dt == "float32") > bucket_mb * 2**20
