"""Turning logits into tokens, batched, on the rank that computed them (its attention group's
ranks all hold the full logits and sample alike).

Order: penalties (repetition over prompt and output, frequency/presence over output), the logit
bias and the min-tokens mask (the ids that would end a request too short), the grammar's mask
(structured output, `grammar.py`), temperature, top-k,
top-p, min-p, then a draw. Greedy rows take the argmax. A seeded request draws on the host,
its draw for the token at position p from a generator seeded by (seed, p): the same token whatever
else is in the batch, whatever the TP size, after a preemption, and on a decode instance that goes
on where its prefill stopped. The other sampled rows draw on the device from the group's generator
(seeded by `random_seed`) by the exponential race, which draws from the same distribution with no
host sync.
Logprobs are those of the model's own distribution (log-softmax of the raw logits). Results stay
on the device (`Sampled`) until the step's result is copied to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dserve.scheduler.request import SamplingParams
from dserve.step.grammar import apply_masks


def seeded_generator(seed: int, position: int) -> torch.Generator:
    """The generator a request seeded with `seed` draws the token at `position` from."""
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + position) % 2**63)


def device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints on `device` without waiting for the device (through pinned memory on a GPU)."""
    pinned = device.type == "cuda"
    host = torch.tensor(values, dtype=torch.int64, pin_memory=pinned)
    return host.to(device, non_blocking=True)


def _penalise(logits: torch.Tensor, reqs) -> torch.Tensor:
    """`reqs` carry `params`, `all_ids` and `output_ids` (the tokens the penalties count)."""
    for row, req in enumerate(reqs):
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_ids)), device=logits.device)
            vals = logits[row, seen]
            penalised = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
            logits[row, seen] = penalised
        if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
            outputs = torch.tensor(req.output_ids, device=logits.device)
            ids, counts = outputs.unique(return_counts=True)
            counts = counts.to(logits.dtype)
            logits[row, ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


def _bias_and_mask(logits: torch.Tensor, reqs, positions: list[int]) -> torch.Tensor:
    """`logit_bias` added; a request short of `min_new_tokens` (the token at `positions[row]`
    is output number `position - prompt_len`) has the ids that would end it masked out."""
    for row, req in enumerate(reqs):
        p = req.params
        pairs = p.bias
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], device=logits.device)
            values = torch.tensor([v for _, v in pairs], device=logits.device)
            logits[row, ids] += values.to(logits.dtype)
        if req.end_ids and positions[row] - req.prompt_len < p.min_new_tokens:
            logits[row, list(req.end_ids)] = float("-inf")
    return logits


def has_masks(req) -> bool:
    """Whether sampling changes `req`'s logits beyond penalties: a bias or a min-tokens mask."""
    return bool(req.params.logit_bias) or bool(req.end_ids)


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or bool(params.frequency_penalty)
        or bool(params.presence_penalty)
    )


def processed_probs(logits: torch.Tensor, reqs) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied row-wise; returns probabilities."""
    device, vocab = logits.device, logits.shape[1]
    params = [r.params for r in reqs]
    temps = torch.tensor([max(p.temperature, 1e-6) for p in params], device=device)
    logits = logits / temps[:, None]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_k = torch.tensor(top_k, device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    probs = probs.masked_fill(before > top_p[:, None], 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


@dataclass
class Sampled:
    """A step's sampled tokens on the device, with the logprobs asked for."""

    ids: torch.Tensor
    """[N] int64."""
    logprobs: torch.Tensor | None = None
    """[N] of the chosen tokens, when a row asked."""
    top_values: torch.Tensor | None = None
    """[N, k], k the most top logprobs a row asked for."""
    top_ids: torch.Tensor | None = None


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.device_generator = torch.Generator(device).manual_seed(seed)
        self.host_generator = torch.Generator().manual_seed(seed)
        """Unseeded requests' draws on the host (speculative verification)."""

    def generator_of(self, req, position: int) -> torch.Generator:
        """Where a draw on the host for `req`'s token at `position` comes from."""
        seed = req.params.seed
        return self.host_generator if seed is None else seeded_generator(seed, position)

    def sample(self, logits: torch.Tensor, reqs, positions: list[int]) -> Sampled:
        """`logits` [N, vocab] float32, one row per request of `reqs` (`RankRequest`s), whose
        next tokens are at `positions`."""
        raw = logits
        if any(has_penalties(r.params) for r in reqs):
            logits = _penalise(logits.clone(), reqs)
        if any(has_masks(r) for r in reqs):
            logits = _bias_and_mask(logits.clone(), reqs, positions)
        if any(getattr(r, "grammar", None) for r in reqs):
            logits = logits.clone() if logits is raw else logits
            apply_masks(logits, reqs)
        ids = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        drawn = [i for i in sampled if reqs[i].params.seed is None]
        if drawn:
            ids[device_ints(drawn, self.device)] = self._race(logits, reqs, drawn)
        seeded = [i for i in sampled if reqs[i].params.seed is not None]
        if seeded:
            draws = self._draw_on_host(logits, reqs, seeded, positions)
            ids[device_ints(seeded, self.device)] = draws
        if not any(r.params.return_logprob for r in reqs):
            return Sampled(ids)
        logprobs = raw.log_softmax(dim=-1)
        chosen = logprobs.gather(1, ids[:, None])[:, 0]
        k = max(r.params.top_logprobs_num for r in reqs)
        if not k:
            return Sampled(ids, chosen)
        top = logprobs.topk(k, dim=-1)
        return Sampled(ids, chosen, top.values, top.indices)

    def _race(self, logits: torch.Tensor, reqs, rows: list[int]) -> torch.Tensor:
        """Draws for `rows` on the device: argmax of p / E with E ~ Exp(1) is a draw from p."""
        index = device_ints(rows, self.device)
        probs = processed_probs(logits[index], [reqs[i] for i in rows])
        noise = torch.empty_like(probs).exponential_(generator=self.device_generator)
        return (probs / noise).argmax(dim=-1)

    def _draw_on_host(self, logits, reqs, rows: list[int], positions: list[int]) -> torch.Tensor:
        """Draws for seeded `rows`, each from its own generator (waits for the step)."""
        index = device_ints(rows, self.device)
        probs = processed_probs(logits[index], [reqs[i] for i in rows]).cpu()
        drawn = []
        for j, i in enumerate(rows):
            generator = self.generator_of(reqs[i], positions[i])
            drawn.append(int(torch.multinomial(probs[j], 1, generator=generator)[0]))
        return device_ints(drawn, self.device)
