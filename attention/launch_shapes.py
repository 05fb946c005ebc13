"""How many programs the Gluon kernels launch: the MLA decode's splits of
each context (`mla_splits`) and the indexer's positions a program
(`indexer_per_program`), from the device's SMs and memory bandwidth.

Pure Python over a few device properties, so the choices are checked on any
host (tests/attention/test_launch_shapes.py); the kernels are in
`gluon_mla` and `gluon_indexer`.
"""

from __future__ import annotations

import functools

import torch

BLOCK_TOKENS = 64  # positions a block of either kernel: one TMA box, within a page
MLA_HEADS = 64  # heads an MLA program: one warpgroup's MMA rows
PARTIAL_BYTES = MLA_HEADS * 512 * 4 * 2  # a split's partial output: written, then merged
ROW_BYTES = 576 * 2  # a position's latent and rope key (16-bit)
SM_BYTES_PER_S = 42e9  # what one program (one SM) reads at most: H100, ~60% of SMs fill HBM


def mla_splits(batch: int, heads: int, max_len: int, device, gathered=False) -> int:
    """Splits of each context (a power of two: the merge compiles one variant
    per count; no split under four blocks, two over sparse attention's
    gathered positions), by a cost model of the programs' rounds: a
    program holds a whole SM (216 KB of shared memory), a round of programs
    reads at the memory's bandwidth once it has `saturating_programs` of
    them (fewer each read at one SM's most), and each split adds its
    partial output's bytes. Against "about one program an SM" (the rule
    until session 34), H100, 64 heads at 8k: batch 80 0.343 -> 0.277 ms,
    160 0.649 -> 0.578; 128 heads at 8k, batch 80 0.487 -> 0.408; sparse
    (2048 positions) batch 80 0.127 -> 0.108; the same where the old rule
    was right (bench/notes/session34-h100-2026-11-27.md)."""
    props = torch.cuda.get_device_properties(device)
    programs = batch * -(-heads // MLA_HEADS)
    rounds = (props.multi_processor_count, saturating_programs(props))
    return splits_for(programs, max_len, gathered, rounds)


def splits_for(programs: int, max_len: int, gathered: bool, rounds: tuple[int, int]) -> int:
    """`mla_splits`' choice for `programs` (sequences x head groups) over
    `max_len` positions, `rounds` = (SMs, saturating programs)."""
    sms, saturating = rounds
    most = max(1, min(256, max_len // ((2 if gathered else 4) * BLOCK_TOKENS)))

    def cost(splits: int) -> float:
        total = programs * splits
        full, last = divmod(total, sms)
        width = full * sms + (max(last, saturating) if last else 0)
        partials = PARTIAL_BYTES * splits / (max(max_len, 1) * ROW_BYTES)
        return width / total * (1 + partials)

    counts = [1 << k for k in range(most.bit_length())]
    return min(counts, key=cost)


def saturating_programs(props) -> int:
    """Programs (one an SM) that read at the memory's bandwidth: its peak over
    one SM's most (`SM_BYTES_PER_S`), at most every SM."""
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    sms = props.multi_processor_count
    if not clock_khz or not bus_bits:
        return round(0.6 * sms)
    peak = 2 * clock_khz * 1e3 * bus_bits / 8
    return min(sms, round(peak / SM_BYTES_PER_S))


def indexer_per_program(tokens: int, width: int, device) -> int:
    """Positions an indexer program takes (whole blocks). See
    `per_program_for`."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = -(-width // BLOCK_TOKENS)
    return per_program_for(tokens, blocks, sms) * BLOCK_TOKENS


@functools.lru_cache(maxsize=4096)
def per_program_for(tokens: int, blocks: int, sms: int) -> int:
    """Blocks an indexer program takes, each token's `blocks` split in
    parts: the parts that fill one round of the SMs best, if that fills 90%
    of them; else the fewest parts whose programs fill their last round to
    90%. Up to three programs share an SM (8 stages of 8 KB); a round that
    leaves SMs idle, or gives some two programs and others one, leaves
    bandwidth unused. FP8 queries on an H100 at 32k, % of the copy
    bandwidth, against one program an SM (the rule until session 34):
    batch 160 92 against 79, 80 89 against 86, 100 90 against 90; the
    same at 8-64, 128 and 256 (bench/notes/session34-h100-2026-11-27.md)."""

    def fill(parts: int) -> tuple[float, int]:
        per = -(-blocks // parts)
        programs = tokens * -(-blocks // per)
        rounds = -(-programs // sms)
        return programs / (sms * rounds), per

    one_round = range(1, min(blocks, max(sms // tokens, 1)) + 1)
    best = max((fill(parts) for parts in one_round), key=lambda f: (f[0], -f[1]))
    if best[0] >= 0.9:
        return best[1]
    for parts in range(2, min(blocks, 16) + 1):
        filled, per = fill(parts)
        if filled >= 0.9:
            return per
    return best[1]
