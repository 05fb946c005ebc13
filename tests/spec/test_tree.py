"""Draft trees (topk > 1): their shape, the walk that verifies them (greedy and sampled), and the
engine verifying a tree whose right path is not its first branch, so the accepted nodes' KV has to
move into place before the next step reads it."""

from __future__ import annotations

import pytest
import torch

from dserve.runtime.connector import KVConnector, Prefilled
from dserve.spec.tree import (
    Candidate,
    accept_greedy,
    accept_sampled,
    ancestor_mask,
    depths,
    is_chain,
    select,
)
from tests.spec.test_acceptance import chi_square_same_distribution
from tests.spec.test_mtp import GREEDY, prompts, replace_drafts

#            0  1  2  3  4  5
PARENTS = [-1, -1, 0, 1, 1, 4]  # root -> {0, 1}; 0 -> 2; 1 -> {3, 4}; 4 -> 5
TOKENS = [10, 11, 12, 13, 14, 15]


def test_tree_shape():
    assert depths(PARENTS) == [1, 1, 2, 2, 2, 3]
    assert is_chain([-1, 0, 1]) and not is_chain(PARENTS)
    mask = ancestor_mask(PARENTS)  # rows and columns: root, then the nodes
    assert mask[6].tolist() == [
        True,
        False,
        True,
        False,
        False,
        True,
        True,
    ]  # node 5: root, 1, 4, itself
    assert mask[3].tolist() == [
        True,
        True,
        False,
        True,
        False,
        False,
        False,
    ]  # node 2: root, 0, itself
    assert mask[0].tolist() == [True] + [False] * 6
    # a chain is causal
    assert torch.equal(ancestor_mask([-1, 0, 1]), torch.ones(4, 4, dtype=torch.bool).tril())


def test_select_keeps_every_parent_and_orders_breadth_first():
    cands = [
        Candidate(1, -1, -0.1, 1),
        Candidate(2, -1, -2.0, 1),  # root's children
        Candidate(3, 0, -0.3, 2),
        Candidate(4, 0, -0.35, 2),
        Candidate(5, 1, -2.5, 2),
        Candidate(6, 2, -0.3, 3),
    ]  # a child may tie its parent (p = 1): the parent still comes first
    tokens, parents = select(cands, 4)
    assert tokens == [1, 3, 4, 6] and parents == [-1, 0, 0, 1]
    tokens, parents = select(cands, 6)
    assert tokens == [1, 2, 3, 4, 5, 6] and parents == [-1, -1, 0, 0, 1, 2]


def test_greedy_walk_takes_the_branch_the_target_agrees_with():
    # target after: root -> 11 (node 1), node 1 -> 14 (node 4), node 4 -> 15 (node 5), node 5 -> 7
    assert accept_greedy(TOKENS, PARENTS, [11, 0, 14, 0, 0, 15, 7]) == ([1, 4, 5], [11, 14, 15, 7])
    # node 4's child is wrong: the target's 3 instead
    assert accept_greedy(TOKENS, PARENTS, [11, 0, 14, 0, 0, 3, 7]) == ([1, 4], [11, 14, 3])
    # no child of the root: the target's own token only
    assert accept_greedy(TOKENS, PARENTS, [9, 0, 0, 0, 0, 0, 0]) == ([], [9])


def test_sampled_walk_keeps_the_target_distribution():
    """The first emitted token over many draws, against draws from the target itself: the root's
    three children, tried in turn, leave the token distributed as p (recursive rejection)."""
    vocab, n = 8, 20000
    p = torch.tensor([0.3, 0.25, 0.15, 0.1, 0.1, 0.05, 0.03, 0.02])
    tokens, parents = [5, 0, 3], [-1, -1, -1]  # a poor first guess, then two likely ones
    probs = p.expand(4, vocab).clone()
    gen = torch.Generator().manual_seed(0)
    ours = [accept_sampled(tokens, parents, probs, gen)[1][0] for _ in range(n)]
    theirs = torch.multinomial(
        p, n, replacement=True, generator=torch.Generator().manual_seed(1)
    ).tolist()
    assert chi_square_same_distribution(ours, theirs) > 1e-3
    assert sum(t == 0 for t in ours) / n == pytest.approx(0.3, abs=0.02)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_engine_verifies_a_tree_off_its_first_branch(arch, tiny_dir, make_engine):
    """An oracle draft proposes a tree whose first branch is wrong at every level and whose right
    path is its last one: each verify takes the whole right path (3 tokens + the target's own),
    and the output is still the target's, so the accepted nodes' KV was moved into place. Small
    pages put the moves across page boundaries; both pools' invariants hold after."""
    path = tiny_dir(arch, mtp=True)
    ids = prompts(1)[0]
    expected = make_engine(path).generate(input_ids=[ids], sampling_params=GREEDY)[0].output_ids
    engine = make_engine(
        path,
        speculative_algorithm="mtp",
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=7,
        page_size=4,
    )
    oracle = ids + expected + [0] * 8

    def tree(req):  # a tree around the known answer, its right path last at every level
        right = oracle[req.num_tokens : req.num_tokens + 3]
        wrong = [(t + 1) % 100 for t in right]
        # nodes: 0 wrong1, 1 right1, 2 wrong2 (under 1), 3 right2 (under 1), 4 wrong3,
        # 5 right3 (under 3)
        tokens = [wrong[0], right[0], wrong[1], right[1], wrong[2], right[2]]
        return tokens, [-1, -1, 1, 1, 3, 3]

    replace_drafts(engine, tree)
    got = engine.generate(input_ids=[ids], sampling_params=GREEDY)[0]
    assert got.output_ids == expected
    assert got.meta["spec_accepted_per_step"][:-1] == [3] * (
        len(got.meta["spec_accepted_per_step"]) - 1
    )
    engine.check_invariants()


class Arriving(KVConnector):
    """A decode's connector without the transport: every prompt's KV arrives."""

    pages = None

    def arriving_tokens(self, req) -> int:
        return len(req.prompt_ids)

    def allocated(self, req, pages) -> None:
        self.pages = pages


@pytest.mark.parametrize(
    "tokens,parents",
    [
        ([1, 2], [-1, 1]),  # a parent after its child
        ([1, 2], [-1]),  # lengths differ
        ([1, 10**9], [-1, 0]),  # a token outside the vocabulary
        ([1, "x"], [-1, 0]),  # not a token at all
        ([1, 2, 3], [-1, 0, 1]),  # deeper than our 2 steps
        ([1] * 5, [-1] * 5),
    ],
)  # more nodes than our 4
def test_a_malformed_tree_from_a_peer_is_dropped(tokens, parents, tiny_dir, make_engine):
    """A decode that receives a bad draft tree with its first token drafts anew instead of crashing."""
    engine = make_engine(
        tiny_dir("deepseek_v3", mtp=True),
        speculative_algorithm="mtp",
        speculative_num_steps=2,
        speculative_eagle_topk=2,
    )
    engine.connector = Arriving(engine)
    req = engine.make_request(input_ids=prompts(1)[0], sampling_params=GREEDY)
    engine.submit(req)
    engine.poll()
    assert engine.connector.pages is not None
    engine.join(req.rid, Prefilled(7, draft_tokens=tokens, draft_parents=parents))
    assert req.draft_tokens == [] and req.draft_parents == []
    while not req.finished:
        engine.step()
    assert len(req.output_ids) == GREEDY["max_new_tokens"]
    engine.forget(req.rid)
