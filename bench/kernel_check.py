"""Kernel correctness at real shapes on a GPU: each fast kernel against its torch reference, in bf16,
at DeepSeek-V3's attention shapes (128 and 16 heads, kv_lora_rank 512, rope 64, page size 64), GLM-4.5's
MHA shapes (96 query heads over 8 KV heads of 128) and DeepSeek-V3's expert shapes (hidden 7168, moe
intermediate 2048, top 8):

    python -m bench.kernel_check [--backends triton,flashinfer]

Attention runs through the backends (store of the new tokens, then decode / extend / draft-tree
attention over scattered pages) against `TorchBackend` on the same pool and batch; norms, rotary and
the routed experts against their torch modules. Prints the largest error relative to the reference's
largest magnitude, next to the tolerance (bf16 keeps 8 bits: 2^-8 per rounding; sums over thousands of
terms, a few of those), and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from dserve.attention.backend import ForwardBatch, create_backend
from dserve.attention.torch_backend import TorchBackend
from dserve.scheduler.kv_pool import KVLayout, KVPool

BF16 = torch.bfloat16
ATTENTION_TOL = 2e-2
# (new tokens, context after the step, draft-tree tail or None)
SPANS = {"decode": [(1, n, None) for n in (1, 64, 1000, 8191, 32768)],
         "extend": [(700, 700, None), (300, 1500, None), (1, 90, None), (8, 200, None)],
         "tree": [(8, 200, 9), (4, 4000, 5)]}


def random_batch(pool: KVPool, spans, gen) -> ForwardBatch:
    ps = pool.layout.page_size
    pages = [-(-seq_len // ps) for _, seq_len, _ in spans]
    order = torch.randperm(pool.num_pages, generator=gen)
    table = torch.zeros(len(spans), max(pages), dtype=torch.int64)
    slots, positions, masks, used = [], [], [], 0
    for i, ((q_len, seq_len, tail), n) in enumerate(zip(spans, pages)):
        table[i, :n] = order[used:used + n]
        used += n
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(table[i, pos // ps] * ps + pos % ps)
        positions.append(pos)
        mask = None
        if tail is not None:  # each token sees the tail's first position, itself, others at random
            mask = torch.rand(q_len, tail, generator=gen) < 0.5
            mask[:, 0] = True
            mask[torch.arange(q_len), tail - q_len + torch.arange(q_len)] = True
        masks.append(mask)
    tokens = sum(q for q, _, _ in spans)
    return ForwardBatch(torch.zeros(tokens, dtype=torch.int64), torch.cat(positions), [q for q, _, _ in spans],
                        [s for _, s, _ in spans], table, torch.cat(slots), torch.arange(tokens),
                        tree_masks=masks).to(torch.device("cuda"))


def relative_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def attention_error(backend: str, layout: KVLayout, spans, make_inputs, forward) -> float:
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(layout, 2 * sum(-(-s // layout.page_size) for _, s, _ in spans) + 1, "cuda")
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=gen).to(layout.dtype))
    batch = random_batch(pool, spans, gen)
    inputs = make_inputs(batch.num_tokens, gen)
    outs = []
    for b in (TorchBackend(pool), create_backend(backend, pool)):
        b.plan(batch)
        outs.append(forward(b, *inputs))
    return relative_error(*outs)


def mla_rows(backends: list[str]) -> list[dict]:
    rows = []
    for heads in (128, 16):
        layout = KVLayout("mla", 1, 64, BF16, latent_dim=576, kv_lora_rank=512)
        make = lambda t, gen, h=heads: [torch.randn(*s, generator=gen).to("cuda", BF16)
                                        for s in ((t, h, 512), (t, h, 64), (t, 576))]
        forward = lambda b, ql, qr, lat: b.forward_mla(0, ql, qr, lat, 576 ** -0.5)
        for backend in backends:
            for kind, spans in SPANS.items():
                err = attention_error(backend, layout, spans, make, forward)
                rows.append({"kernel": f"MLA {kind} ({backend})", "shape": f"{heads} heads", "error": err,
                             "tolerance": ATTENTION_TOL})
    return rows


def mha_rows(backends: list[str]) -> list[dict]:
    rows = []
    layout = KVLayout("mha", 1, 64, BF16, num_kv_heads=8, head_dim=128, v_head_dim=128)
    make = lambda t, gen: [torch.randn(t, h, 128, generator=gen).to("cuda", BF16) for h in (96, 8, 8)]
    forward = lambda b, q, k, v: b.forward_mha(0, q, k, v, 128 ** -0.5)
    for backend in backends:
        for kind, spans in SPANS.items():
            err = attention_error(backend, layout, spans, make, forward)
            rows.append({"kernel": f"MHA {kind} ({backend})", "shape": "96/8 heads x 128", "error": err,
                         "tolerance": ATTENTION_TOL})
    return rows


def elementwise_rows() -> list[dict]:
    from dserve.attention.triton_norm import rms_norm
    from dserve.attention.triton_rotary import apply_rotary
    from dserve.models.config import RopeConfig
    from dserve.models.layers.norm import RMSNorm
    from dserve.models.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    rows = []
    norm = RMSNorm(7168, 1e-6).to("cuda", BF16)
    norm.weight.copy_(torch.rand(7168, generator=gen) + 0.5)
    x, r = [(torch.randn(256, 7168, generator=gen) * 3).to("cuda", BF16) for _ in range(2)]
    out, _ = rms_norm(x, norm.weight, norm.eps, r)
    rows.append({"kernel": "residual add + RMSNorm", "shape": "256 x 7168", "error": relative_error(norm(x + r), out),
                 "tolerance": 2 ** -7})
    emb = RotaryEmbedding(RopeConfig(rotary_dim=64, theta=10000.0, interleaved=True)).to("cuda")
    q = torch.randn(256, 128, 192, generator=gen).to("cuda", BF16)[..., 128:]
    cos, sin = emb.cos_sin(torch.randint(0, 32768, (256,), generator=gen).to("cuda"), BF16)
    rows.append({"kernel": "rotary (interleaved)", "shape": "256 x 128 heads x 64 of 192",
                 "error": relative_error(emb.apply(q, cos, sin), apply_rotary(q, cos, sin, True)), "tolerance": 0.0})
    return rows


def moe_rows() -> list[dict]:
    from dserve.attention.triton_moe import fused_experts
    from dserve.models.layers.moe import Experts

    gen, rows = torch.Generator("cuda").manual_seed(2), []
    w13 = (torch.randn(32, 4096, 7168, generator=gen, device="cuda") / 7168 ** 0.5).to(BF16)
    w2 = (torch.randn(32, 7168, 2048, generator=gen, device="cuda") / 2048 ** 0.5).to(BF16)
    experts = Experts.__new__(Experts)  # the torch experts on these stacked weights
    torch.nn.Module.__init__(experts)
    experts.w13, experts.w2 = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)
    experts.first, experts.num_local, experts.use_kernel = 0, 32, False
    for tokens in (1, 32, 256):
        x = torch.randn(tokens, 7168, generator=gen, device="cuda").to(BF16)
        ids = torch.stack([torch.randperm(32, generator=gen, device="cuda")[:8] for _ in range(tokens)])
        weights = torch.rand(tokens, 8, generator=gen, device="cuda")
        rows.append({"kernel": "routed experts (grouped GEMM)", "shape": f"{tokens} tokens, 32 experts, top 8",
                     "error": relative_error(experts(x, weights, ids), fused_experts(x, w13, w2, weights, ids, 0)),
                     "tolerance": ATTENTION_TOL})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", type=lambda s: s.split(","), default=["triton"],
                        help="attention backends to check: triton, flashinfer")
    parser.add_argument("--out", default="bench/results/kernel_check.json")
    args = parser.parse_args()
    rows = mla_rows(args.backends) + mha_rows(args.backends) + elementwise_rows() + moe_rows()
    print(f"{'kernel':<34} {'shape':<34} {'rel. error':>10} {'tolerance':>10}  ok")
    for r in rows:
        r["ok"] = r["error"] <= r["tolerance"]
        print(f"{r['kernel']:<34} {r['shape']:<34} {r['error']:>10.2e} {r['tolerance']:>10.2e}  "
              f"{'yes' if r['ok'] else 'NO'}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}; {sum(r['ok'] for r in rows)} of {len(rows)} within tolerance")


if __name__ == "__main__":
    main()
