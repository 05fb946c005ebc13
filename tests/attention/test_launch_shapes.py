"""The Gluon kernels' launch shapes (`attention/launch_shapes.py`): the MLA
decode's splits and the indexer's positions a program, over batches and
contexts, on any host (the choices are pure Python)."""

from __future__ import annotations

import pytest

from dserve.attention import launch_shapes

SMS = (132, 80)  # an H100's SMs and the programs that read at its memory's bandwidth


@pytest.mark.parametrize("gathered", [False, True])
def test_splits_are_powers_of_two_within_the_context(gathered):
    """Every choice is a power of two (the merge's variants) that leaves each
    split at least its shortest run of blocks, for any batch and context."""
    shortest = (2 if gathered else 4) * launch_shapes.BLOCK_TOKENS
    for programs in range(1, 400, 7):
        for max_len in (1, 64, 300, 2048, 8192, 131072):
            splits = launch_shapes.splits_for(programs, max_len, gathered, SMS)
            assert splits & (splits - 1) == 0
            assert splits == 1 or max_len // splits >= shortest


def test_splits_never_leave_a_small_last_round():
    """A split count whose programs end in a round narrower than the
    saturating programs is never chosen over one that fills its rounds
    with no more splits' outputs (the case the cost model exists for)."""
    sms, saturating = SMS
    for programs in range(1, 400):
        splits = launch_shapes.splits_for(programs, 8192, False, SMS)
        last = programs * splits % sms
        if 0 < last < saturating:
            fewer = [s for s in (1, 2, 4, 8) if s < splits]
            assert all(0 < programs * s % sms < saturating for s in fewer)


def test_programs_per_token_cover_the_context_in_whole_blocks():
    """Each token's blocks split in equal runs that cover them all; where some
    split fills one round of the SMs to 90%, the choice is one such round."""
    sms = 132
    for tokens in range(1, 300, 3):
        for blocks in (1, 2, 7, 32, 512, 2048):
            per = launch_shapes.per_program_for(tokens, blocks, sms)
            programs = tokens * -(-blocks // per)
            assert 1 <= per <= blocks and (programs // tokens - 1) * per < blocks
            one_round = [
                tokens * -(-blocks // -(-blocks // parts))
                for parts in range(1, max(sms // tokens, 1) + 1)
            ]
            if max((n for n in one_round if n <= sms), default=0) >= 0.9 * sms:
                assert 0.9 * sms <= programs <= sms
