"""What the Hopper Gluon kernels (`gluon_mla`, `gluon_indexer`) share:
Triton's Gluon (`HAVE_GLUON` is False on a Triton without it), TMA
descriptors and the check that TMA can read a tensor, the stage rings
the loaders fill, and the loaders' page-table reads a group of blocks
ahead. (The dependent launch's wait and trigger are Triton's own
`gdc_wait` / `gdc_launch_dependents`, which Gluon kernels call too.)
"""

from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # TMA loads: `async_load` in later Tritons (3.9), the older name in 3.6
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    HAVE_GLUON = True
except ImportError:  # an older Triton: the Triton kernels serve
    HAVE_GLUON = False


def tma_readable(x: torch.Tensor) -> bool:
    """Whether TMA can read `x`: unit inner stride, its address and other
    strides multiples of 16 bytes."""
    size = x.element_size()
    outer = all(s * size % 16 == 0 for s in x.stride()[:-1])
    return x.stride(-1) == 1 and outer and x.data_ptr() % 16 == 0


def descriptor(x: torch.Tensor, block: list[int], kind):
    """A TMA descriptor of `x` by boxes of `block`, in the shared layout
    the MMAs read (`kind`: the Gluon dtype)."""
    layout = gl.NVMMASharedLayout.get_default_for(block, kind)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


if HAVE_GLUON:

    @gluon.jit
    def ring(desc, STAGES: gl.constexpr):
        """Shared memory for STAGES of a descriptor's blocks (its boxes),
        in the layout its TMA writes."""
        block = desc.block_type
        shape: gl.constexpr = [STAGES] + block.shape
        return gl.allocate_shared_memory(block.element_ty, shape, desc.layout)

    @gluon.jit
    def block_pages(run, k0, BLOCK_N: gl.constexpr):
        """The pages of a run's blocks k0 .. k0 + 31, one a lane of a warp
        (0 past its blocks). `run`: (the sequence's page table, the run's
        first position, its blocks, the page size)."""
        table, start, blocks, page_size = run
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        k = k0 + gl.arange(0, 32, layout=lanes)
        at = (start + k * BLOCK_N) // page_size
        return gl.load(table + at, mask=k < blocks, other=0).to(gl.int32)

    @gluon.jit
    def block_page(run, k, pages, ahead, BLOCK_N: gl.constexpr):
        """Block k's page for a loader warp, from its group of 32
        (`pages`), the next group read as this one starts (`ahead`), so
        that no copy waits for a read of the page table: returns the
        page and the groups for block k + 1."""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        j = k % 32
        if j == 0:
            ahead = block_pages(run, k + 32, BLOCK_N)
        lane = gl.arange(0, 32, layout=lanes)
        page = gl.sum(gl.where(lane == j, pages, 0), 0)
        if j == 31:
            pages = ahead
        return page, pages, ahead
