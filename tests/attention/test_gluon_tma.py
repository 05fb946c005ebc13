"""What TMA can read (`attention/gluon_tma.tma_readable`), on any host: the
queries' and caches' views the Gluon kernels take, and those they copy
first (`gluon_mla._tma_ready`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dserve.attention import gluon_mla  # noqa: E402
from dserve.attention.gluon_tma import tma_readable  # noqa: E402


def test_the_engine_views_are_readable():
    """A contiguous tensor, and the latent and rope parts of one [B, H, 576]
    query (rows of 1152 bytes, the rope part 1024 bytes in)."""
    q = torch.zeros(3, 16, 576, dtype=torch.bfloat16)
    assert tma_readable(q)
    assert tma_readable(q[..., :512]) and tma_readable(q[..., 512:])
    assert tma_readable(q.transpose(0, 1))  # any order of 16-byte strides


def test_unaligned_views_are_not():
    """An address off 16 bytes, a row stride off 16 bytes, a strided inner
    dimension: each is refused; `_tma_ready` copies the queries' views
    contiguous (rows of 512 or 64 columns: 16-byte multiples)."""
    q = torch.zeros(3, 16, 576, dtype=torch.bfloat16)
    assert not tma_readable(torch.zeros(3, 16, 7, dtype=torch.bfloat16))  # rows of 14 bytes
    for view in (q[..., 1:513], q[..., ::9]):
        assert not tma_readable(view)
        ready = gluon_mla._tma_ready(view)
        assert tma_readable(ready) and torch.equal(ready, view)
    assert gluon_mla._tma_ready(q) is q
