"""Launch-parameter tables: JSON files beside the kernels that a bench's sweep writes
(`bench.fp8_gemm`, `bench.moe_gemm`) and the kernels read once per process."""

from __future__ import annotations

import functools
import json
import os


@functools.lru_cache(maxsize=None)
def read(path: str) -> dict:
    """The table at `path`; {} when it does not exist (every shape takes the defaults)."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)
