"""Turning the last position's logits into the next token, per request parameters, batched.

Order: penalties (repetition over prompt and output, frequency/presence over output), temperature,
top-k, top-p, min-p, then a draw. Greedy rows take the argmax of the raw logits. Seeded requests
draw from their own generator, so a seed gives the same tokens whatever else is in the batch.
Logprobs are those of the model's own distribution (log-softmax of the raw logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dserve.scheduler.request import Request


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens, for requests that asked
    top_logprobs: list[list[tuple[int, float]]] | None


def _penalise(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    for row, req in enumerate(reqs):
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_ids)), device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
            ids, counts = torch.tensor(req.output_ids, device=logits.device).unique(
                return_counts=True
            )
            logits[row, ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def processed_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied row-wise; returns probabilities."""
    temps = torch.tensor([max(r.params.temperature, 1e-6) for r in reqs], device=logits.device)
    logits = logits / temps[:, None]
    top_k = torch.tensor(
        [r.params.top_k if r.params.top_k > 0 else logits.shape[1] for r in reqs],
        device=logits.device,
    )
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([r.params.top_p for r in reqs], device=logits.device)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    probs = probs.masked_fill(before > top_p[:, None], 0.0)
    min_p = torch.tensor([r.params.min_p for r in reqs], device=logits.device)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def sample(logits: torch.Tensor, reqs: list[Request]) -> SampleOutput:
    """logits [N, vocab] float32, one row per request in `reqs`, on the rank's device or the CPU.
    On a GPU only what is needed crosses to the host: the argmax ids, the sampled rows'
    probabilities (drawn on the host, from each request's own generator), the logprobs asked for."""
    raw = logits
    if any(
        r.params.repetition_penalty != 1.0
        or r.params.frequency_penalty
        or r.params.presence_penalty
        for r in reqs
    ):
        logits = _penalise(logits.clone(), reqs)
    token_ids = logits.argmax(dim=-1).tolist()
    rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
    if rows:
        probs = processed_probs(logits[rows], [reqs[i] for i in rows]).cpu()
        for j, i in enumerate(rows):
            token_ids[i] = int(torch.multinomial(probs[j], 1, generator=reqs[i].generator)[0])
    if not any(r.params.return_logprob for r in reqs):
        return SampleOutput(token_ids, None, None)
    logprobs = raw.log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=raw.device)[:, None])[:, 0].tolist()
    tops = []
    for i, req in enumerate(reqs):
        n = req.params.top_logprobs_num
        if n:
            vals, ids = logprobs[i].topk(n)
            tops.append(list(zip(ids.tolist(), vals.tolist())))
        else:
            tops.append([])
    return SampleOutput(token_ids, chosen, tops)
