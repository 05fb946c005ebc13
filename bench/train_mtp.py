"""Train a tiny target and its MTP (NextN) draft on a synthetic corpus, so acceptance means something.

The corpus is made of a few fixed "phrases" (token sequences) strung together at random: inside a
phrase the next token is certain, at a phrase's end it is not. The target (a tiny DeepSeek-V3 or
GLM-4.5 from `dserve.models.tiny`) learns next-token prediction; the draft learns token i+2 from
the target's hidden state at i and token i+1, as DeepSeek trains its MTP module, with the target's
hidden states detached. The result is a checkpoint in the published layout (target layers, then
`model.layers.{n}.*` NextN tensors), then speculative decoding is measured on it:

    python -m bench.train_mtp --out /tmp/mtp-trained [--arch deepseek_v3] [--steps 300]

prints the training losses, then decode tokens/s and the mean acceptance length (tokens per verify)
with speculation off, with MTP at 1, 2 and 3 draft steps, a draft tree (3 steps, topk 4) and the
naive fused step, and writes JSON. bench/train_eagle3.py
trains an EAGLE-3 draft for the same target and measures it the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from torch import nn

from dserve.models.tiny import (
    _hf_config,
    _model_class,
    append_mtp_layer,
    one_layer_more,
    train_tokenizer,
)

VOCAB = 512


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class NextN(nn.Module):
    """The MTP module around layer `n` of `donor` (a model with one layer more than the target)."""

    def __init__(self, donor, cfg):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer, self.rotary = donor.model.layers[-1], donor.model.rotary_emb
        self.enorm, self.hnorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(hidden)], dim=-1))
        pos = torch.arange(x.shape[1])[None]
        mask = None  # sdpa: causal
        if getattr(self.layer.self_attn, "indexer", None) is not None:  # its scores need one
            n = x.shape[1]
            mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None]
        kwargs = dict(position_ids=pos, attention_mask=mask)
        y = self.layer(x, position_embeddings=self.rotary(x, pos), **kwargs)
        return self.head(self.norm(y[0] if isinstance(y, tuple) else y))


def corpus(num_phrases: int, seed: int):
    """A sampler of token sequences made of `num_phrases` fixed phrases strung together at random."""
    rng = random.Random(seed)
    phrases = [
        [rng.randrange(10, VOCAB) for _ in range(rng.randrange(4, 9))] for _ in range(num_phrases)
    ]

    def sample(n: int) -> list[int]:
        out = []
        while len(out) < n:
            out += rng.choice(phrases)
        return out[:n]

    return sample


def train(
    arch: str, out: str, steps: int, seed: int = 0, log=print, shapes: dict | None = None
) -> dict:
    """Train and write the checkpoint; `shapes` overrides fields of the tiny config (e.g. attention
    dims a kernel library needs). Returns the losses and held-out prompts."""
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(VOCAB)
    cfg = _hf_config(arch, VOCAB, tokenizer.bos_token_id, tokenizer.eos_token_id, 2)
    if shapes:
        cfg = type(cfg)(**{**cfg.to_dict(), **shapes})
    cfg._attn_implementation = "sdpa"  # causal without a mask, in training and in the draft's layer
    target = _model_class(arch)(cfg)
    donor = _model_class(arch)(one_layer_more(cfg))
    donor.config._attn_implementation = "sdpa"
    nextn = NextN(donor, cfg)
    params = list(target.parameters()) + list(nextn.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    sample = corpus(24, seed)
    ce = nn.CrossEntropyLoss()
    losses = []
    for step in range(steps):
        ids = torch.tensor([sample(64) for _ in range(16)])
        hidden = target.model(
            ids
        ).last_hidden_state  # after the final norm, as the engine hands over
        lm = ce(target.lm_head(hidden[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        draft = nextn(target.model.embed_tokens(ids[:, 1:]), hidden[:, :-1].detach())
        mtp = ce(draft[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
        opt.zero_grad()
        (lm + mtp).backward()
        opt.step()
        losses.append((lm.item(), mtp.item()))
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step:4d}  target loss {lm.item():.3f}  draft loss {mtp.item():.3f}")
    target.eval()
    os.makedirs(out, exist_ok=True)
    target.save_pretrained(out, max_shard_size="300KB")
    tokenizer.save_pretrained(out)
    append_mtp_layer(
        out,
        donor,
        {
            "enorm.weight": nextn.enorm.weight,
            "hnorm.weight": nextn.hnorm.weight,
            "eh_proj.weight": nextn.eh_proj.weight,
            "shared_head.norm.weight": nextn.norm.weight,
            "shared_head.head.weight": nextn.head.weight,
            "embed_tokens.weight": target.model.embed_tokens.weight,
        },
    )
    return {
        "arch": arch,
        "steps": steps,
        "final_target_loss": losses[-1][0],
        "final_draft_loss": losses[-1][1],
        "prompts": [sample(12) for _ in range(8)],
    }


def measure(
    path: str,
    prompts: list[list[int]],
    steps_list=(1, 2, 3),
    max_new_tokens: int = 48,
    speculative: dict | None = None,
    topk: int = 1,
    naive: bool = False,
) -> list[dict]:
    """Mean acceptance length (tokens per verify) and tokens/s per draft-step count (draft trees of
    `topk` branches per pass; `naive`: the fused one-call step); output checked equal to the plain
    engine's. `speculative`: the Engine's draft arguments (default: MTP)."""
    from dserve.runtime import Engine

    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    plain = Engine(path, device="cpu", load_progress=False)
    start = time.perf_counter()
    expected = [r.output_ids for r in plain.generate(input_ids=prompts, sampling_params=params)]
    seconds = time.perf_counter() - start
    plain.shutdown()
    tokens = sum(map(len, expected))
    rows = [
        {
            "steps": 0,
            "topk": 0,
            "naive": False,
            "accept_length": 1.0,  # speculation off
            "tokens_per_s": tokens / seconds,
        }
    ]
    for steps in steps_list:
        engine = Engine(
            path,
            device="cpu",
            load_progress=False,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_naive=naive,
            **(speculative or {"speculative_algorithm": "mtp"}),
        )
        start = time.perf_counter()
        got = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        engine.shutdown()
        if [r.output_ids for r in got] != expected:
            raise AssertionError(f"speculation with {steps} steps changed the output")
        tokens = sum(len(r.output_ids) for r in got)
        verifies = sum(r.meta["spec_verify_ct"] for r in got)
        rows.append(
            {
                "steps": steps,
                "topk": topk,
                "naive": naive,
                "accept_length": tokens / verifies,
                "tokens_per_s": tokens / seconds,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument(
        "--arch", default="deepseek_v3", choices=["deepseek_v3", "glm4_moe", "glm_moe_dsa"]
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default="bench/results/train_mtp.json")
    args = parser.parse_args()
    info = train(args.arch, args.out, args.steps)
    rows = (
        measure(args.out, info["prompts"])
        + measure(args.out, info["prompts"], (3,), topk=4)[1:]
        + measure(args.out, info["prompts"], (1,), naive=True)[1:]
    )
    report("mtp", rows, info, args.json)


def report(algorithm: str, rows: list[dict], info: dict, json_path: str) -> None:
    """Print the table of `measure` rows and write them with `info` as JSON."""
    print(f"{'speculation':>16} {'accept length':>14} {'tokens/s (CPU)':>15}")
    for r in rows:
        name = f"{algorithm} x{r['steps']}" if r["steps"] else "off"
        name += f" topk {r['topk']}" if r["topk"] > 1 else ""
        name += " naive" if r["naive"] else ""
        print(f"{name:>16} {r['accept_length']:>14.2f} {r['tokens_per_s']:>15.1f}")
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump({**info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
