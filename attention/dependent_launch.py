"""Programmatic dependent launch (Hopper on): a kernel's programs start
while the launch before it ends, and wait for its writes before they read
anything (`follow`; Gluon kernels call its two instructions directly).

Who launches so (H100): the top-k's three launches (the select at 32 x
32k 25.7 against 27.3 us, bench/notes/session33-h100-2026-11-27.md), the
Gluon MLA decode and the merge of its splits (the sparse step at 32k 3 us
faster at batch 1, 32 and 128; the dense decode the same;
bench/notes/session41-h100-2026-11-27.md). Not the indexer's scores:
letting the top-k's programs start at once had them wait on the SMs for
the scores' whole run, 6-15 us slower (session 34). Loading the MLA's
first blocks before the wait (the blocks the step's store cannot have
written) gained nothing (session 41). Off on the CPU (Triton's
interpreter has none of it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.lru_cache(maxsize=None)
def dependent_launch(device: torch.device) -> dict:
    """The launch options of a kernel that takes `PDL`: on for Hopper and
    later GPUs, off elsewhere."""
    on = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def follow(PDL: tl.constexpr):
    """With `PDL`: let the next launch start its programs, then wait until
    the launch before this one has finished (its writes visible)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
