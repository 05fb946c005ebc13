"""Kernel correctness at real shapes on a GPU: each fast kernel against its torch reference, in bf16,
at DeepSeek-V3's attention shapes (128 and 16 heads, kv_lora_rank 512, rope 64, page size 64), GLM-4.5's
MHA shapes (96 query heads over 8 KV heads of 128), DeepSeek-V3's expert shapes (hidden 7168, moe
intermediate 2048, top 8) and GLM-5's sparse attention (64 heads, latent 512 + 64, indexer 32 x 128,
top-k 2048: the indexer's selection against the float32 reference scores, the sparse MLA on a
given selection):

    python -m bench.kernel_check [--backends triton,flashinfer] [--only dsa,mla_expanded]

Attention runs through the backends (store of the new tokens, then decode / extend / draft-tree
attention over scattered pages) against `TorchBackend` on the same pool and batch; norms, rotary and
the routed experts against their torch modules; the FP8 GEMMs (linears and experts, blocks of 128)
against the products with their weights dequantized. Prints the largest error relative to the reference's
largest magnitude, next to the tolerance (bf16 keeps 8 bits: 2^-8 per rounding; sums over thousands of
terms, a few of those), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from dserve.attention.backend import create_backend
from dserve.models.quant import dequantize
from tests.kernel_cases import mha_case, mla_case, mla_expanded_case

BF16 = torch.bfloat16
ATTENTION_TOL = 2e-2
# (new tokens, context after the step, draft-tree tail or None)
SPANS = {
    "decode": [(1, n, None) for n in (1, 64, 1000, 8191, 32768)],
    "extend": [(700, 700, None), (300, 1500, None), (1, 90, None), (8, 200, None)],
    "tree": [(8, 200, 9), (4, 4000, 5)],
}


def relative_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def named(backend: str):
    return lambda pool: create_backend(backend, pool)


def triton_kernel_only(pool):
    """The triton backend with its Triton MLA decode (not Gluon's on Hopper)."""
    backend = create_backend("triton", pool)
    backend.gluon_mla = False
    return backend


def mla_rows(backends: list[str]) -> list[dict]:
    """Decode at 128 heads runs Gluon's kernel on Hopper (the triton
    backend's default there); the "Triton kernel" row checks the other."""
    rows = [
        {
            "kernel": f"MLA {kind} ({backend})",
            "shape": f"{heads} heads",
            "tolerance": ATTENTION_TOL,
            "error": relative_error(*mla_case(heads, 512, 64, 64, BF16, spans, named(backend))),
        }
        for heads in (128, 16)
        for backend in backends
        for kind, spans in SPANS.items()
    ]
    if "triton" in backends:
        spans = SPANS["decode"]
        rows.append(
            {
                "kernel": "MLA decode (triton, Triton kernel)",
                "shape": "128 heads",
                "tolerance": ATTENTION_TOL,
                "error": relative_error(
                    *mla_case(128, 512, 64, 64, BF16, spans, triton_kernel_only)
                ),
            }
        )
    return rows


def mla_expanded_rows() -> list[dict]:
    """The expanded MLA (prefill form: `triton_expanded`'s kernel) against the absorbed one, both
    through the triton backend, at DeepSeek-V3's shapes (128 heads, nope 128, rope 64, values
    128, latent 512), bf16; the last batch mixes expanded spans with absorbed ones."""
    from dserve.attention.triton_backend import TritonBackend

    cases = [[(2048, 2048)], [(700, 1400)], [(300, 1800)], [(1024, 1800), (4, 90), (1, 300)]]
    rows = []
    for spans in cases:
        absorbed, got = mla_expanded_case(
            128, (128, 64, 128, 512), 64, BF16, [(n, s, None) for n, s in spans],
            TritonBackend, absorbed_class=TritonBackend, min_tokens=64,
        )  # fmt: skip
        rows.append(
            {
                "kernel": "MLA expanded vs absorbed",
                "shape": "128 heads, new/ctx " + ",".join(f"{n}/{s}" for n, s in spans),
                "tolerance": ATTENTION_TOL,
                "error": relative_error(absorbed, got),
            }
        )
    return rows


def mha_rows(backends: list[str]) -> list[dict]:
    return [
        {
            "kernel": f"MHA {kind} ({backend})",
            "shape": "96/8 heads x 128",
            "tolerance": ATTENTION_TOL,
            "error": relative_error(*mha_case(96, 8, 128, 64, BF16, spans, named(backend))),
        }
        for backend in backends
        for kind, spans in SPANS.items()
    ]


def elementwise_rows() -> list[dict]:
    from dserve.kernels.triton_norm import rms_norm
    from dserve.kernels.triton_rotary import apply_rotary
    from dserve.models.config import RopeConfig
    from dserve.models.layers.norm import RMSNorm
    from dserve.models.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    rows = []
    norm = RMSNorm(7168, 1e-6).to("cuda", BF16)
    norm.weight.copy_(torch.rand(7168, generator=gen) + 0.5)
    x, r = [(torch.randn(256, 7168, generator=gen) * 3).to("cuda", BF16) for _ in range(2)]
    out, _, _ = rms_norm(x, norm.weight, norm.eps, r)
    rows.append(
        {
            "kernel": "residual add + RMSNorm",
            "shape": "256 x 7168",
            "error": relative_error(norm(x + r), out),
            "tolerance": 2**-7,
        }
    )
    emb = RotaryEmbedding(RopeConfig(rotary_dim=64, theta=10000.0, interleaved=True)).to("cuda")
    q = torch.randn(256, 128, 192, generator=gen).to("cuda", BF16)[..., 128:]
    cos, sin = emb.cos_sin(torch.randint(0, 32768, (256,), generator=gen).to("cuda"), BF16)
    rows.append(
        {
            "kernel": "rotary (interleaved)",
            "shape": "256 x 128 heads x 64 of 192",
            "error": relative_error(emb.apply(q, cos, sin), apply_rotary(q, cos, sin, True)),
            "tolerance": 0.0,
        }
    )
    return rows


def moe_rows() -> list[dict]:
    from dserve.kernels.triton_moe import fused_experts
    from dserve.models.layers.moe import Experts

    gen, rows = torch.Generator("cuda").manual_seed(2), []
    w13 = (torch.randn(32, 4096, 7168, generator=gen, device="cuda") / 7168**0.5).to(BF16)
    w2 = (torch.randn(32, 7168, 2048, generator=gen, device="cuda") / 2048**0.5).to(BF16)
    experts = Experts.__new__(Experts)  # the torch experts on these stacked weights
    torch.nn.Module.__init__(experts)
    experts.w13, experts.w2 = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)
    experts.first, experts.num_local, experts.use_kernel = 0, 32, False
    for tokens in (1, 32, 256):
        x = torch.randn(tokens, 7168, generator=gen, device="cuda").to(BF16)
        ids = torch.stack(
            [torch.randperm(32, generator=gen, device="cuda")[:8] for _ in range(tokens)]
        )
        weights = torch.rand(tokens, 8, generator=gen, device="cuda")
        rows.append(
            {
                "kernel": "routed experts (grouped GEMM)",
                "shape": f"{tokens} tokens, 32 experts, top 8",
                "error": relative_error(
                    experts(x, weights, ids), fused_experts(x, w13, w2, weights, ids, 0)
                ),
                "tolerance": ATTENTION_TOL,
            }
        )
    return rows


def fp8_moe_rows() -> list[dict]:
    """The grouped GEMMs reading FP8 experts (blocks of 128, W8A8) against the torch experts on
    the same weights dequantized to bf16. Tolerance: one e4m3 rounding of each GEMM's input
    (2^-4 relative), as for the FP8 linears."""
    from dserve.kernels.triton_moe import fused_experts
    from dserve.models.layers.moe import Experts
    from dserve.models.quant import Fp8Scheme, per_row, quantize

    gen, rows = torch.Generator().manual_seed(5), []
    scheme = Fp8Scheme("block", (128, 128))

    def fp8_stack(e: int, n: int, k: int):
        parts = [quantize(torch.randn(n, k, generator=gen) / k**0.5, scheme) for _ in range(e)]
        q = torch.stack([p[0] for p in parts]).cuda()
        s = torch.stack([per_row(p[1], scheme, n) for p in parts]).cuda()
        s = s.transpose(1, 2).contiguous().transpose(1, 2)  # as `finish_fp8` holds them
        return q, s, dequantize(q, s, 128, BF16)

    q13, s13, w13 = fp8_stack(32, 4096, 7168)
    q2, s2, w2 = fp8_stack(32, 7168, 2048)
    experts = Experts.__new__(Experts)
    torch.nn.Module.__init__(experts)
    experts.w13, experts.w2 = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)
    experts.first, experts.num_local, experts.use_kernel = 0, 32, False
    for tokens in (1, 32, 256):
        x = torch.randn(tokens, 7168, generator=gen).to("cuda", BF16)
        ids = torch.stack([torch.randperm(32, generator=gen)[:8] for _ in range(tokens)]).cuda()
        weights = torch.rand(tokens, 8, generator=gen).cuda()
        got = fused_experts(x, q13, q2, weights, ids, 0, scales=(s13, s2), fp8_block=128)
        rows.append(
            {
                "kernel": "routed experts FP8 (grouped GEMM)",
                "shape": f"{tokens} tokens, 32 experts, top 8",
                "error": relative_error(experts(x, weights, ids), got),
                "tolerance": 2**-4,
            }
        )
    return rows


def fp8_rows() -> list[dict]:
    """Every FP8 GEMM at DeepSeek-V3's linear shapes (block 128) against the product with the
    same weights dequantized, in float32. Tolerance: one e4m3 rounding of the activations
    (2^-4 relative), as a bound on the largest error over the largest output."""
    from bench.fp8_gemm import SHAPES, weights
    from dserve.kernels.fp8_gemm import fp8_matmul

    gen, rows = torch.Generator("cuda").manual_seed(3), []
    for name, (n, k) in SHAPES.items():
        q, scale, _ = weights(n, k, 128)
        dense = dequantize(q, scale, 128)
        for m in (1, 64, 1024):
            x = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
            rows.append(
                {
                    "kernel": f"FP8 GEMM {name}",
                    "shape": f"M {m}, N {n}, K {k}",
                    "error": relative_error(x.float() @ dense.T, fp8_matmul(x, q, scale, 128)),
                    "tolerance": 2**-4,
                }
            )
    return rows


def fp8_o_proj_rows() -> list[dict]:
    """MLA's output into an FP8 o_proj as a step runs it (`models.quant.value_up`: W_UV's
    product quantized in its own launch, then o_proj's GEMM on that FP8 form) at
    DeepSeek-V3's shapes (128 heads, latent 512, V 128, o_proj 7168 x 16384 in blocks of 128),
    against the float32 product of the same inputs and dequantized weight. Tolerance: one
    e4m3 rounding of o_proj's input (2^-4), as for the GEMMs."""
    from torch import nn

    from bench.fp8_gemm import weights
    from dserve.models.quant import fp8_linear, value_up

    gen, rows = torch.Generator("cuda").manual_seed(4), []
    q, scale, _ = weights(7168, 128 * 128, 128)
    scale.block = 128
    o_proj = nn.Module()
    o_proj.weight, o_proj.weight_scale = q, scale
    dense = dequantize(q, scale, 128)
    w_uv = (torch.randn(128, 128, 512, generator=gen, device="cuda") / 512**0.5).to(BF16)
    for m in (1, 64, 1024):
        o = torch.randn(m, 128, 512, generator=gen, device="cuda").to(BF16)
        out = torch.bmm(o.float().transpose(0, 1), w_uv.float().transpose(1, 2))
        ref = out.transpose(0, 1).flatten(1) @ dense.T
        rows.append(
            {
                "kernel": "FP8 o_proj after W_UV",
                "shape": f"M {m}, 128 heads, N 7168, K 16384",
                "error": relative_error(ref, fp8_linear(value_up(o, w_uv, o_proj), o_proj)),
                "tolerance": 2**-4,
            }
        )
    return rows


def dsa_rows(backends: list[str]) -> list[dict]:
    """GLM-5's sparse attention: `bench/kernel_check_dsa.py`."""
    from bench.kernel_check_dsa import dsa_rows as rows

    return rows(backends)


GROUPS = {  # name: rows(backends)
    "mla": mla_rows,
    "mla_expanded": lambda _: mla_expanded_rows(),
    "mha": mha_rows,
    "elementwise": lambda _: elementwise_rows(),
    "moe": lambda _: moe_rows(),
    "fp8": lambda _: fp8_rows() + fp8_o_proj_rows(),
    "fp8_moe": lambda _: fp8_moe_rows(),
    "dsa": dsa_rows,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backends",
        type=lambda s: s.split(","),
        default=["triton"],
        help="attention backends to check: triton, flashinfer",
    )
    parser.add_argument("--out", default="bench/results/kernel_check.json")
    parser.add_argument(
        "--only",
        type=lambda v: v.split(","),
        default=None,
        help="groups of rows to run (default: all): " + ", ".join(GROUPS),
    )
    args = parser.parse_args()
    rows = []
    for name in args.only or list(GROUPS):
        rows += GROUPS[name](args.backends)
    print(f"{'kernel':<34} {'shape':<34} {'rel. error':>10} {'tolerance':>10}  ok")
    for r in rows:
        r["ok"] = r["error"] <= r["tolerance"]
        print(
            f"{r['kernel']:<34} {r['shape']:<34} {r['error']:>10.2e} {r['tolerance']:>10.2e}  "
            f"{'yes' if r['ok'] else 'NO'}"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}; {sum(r['ok'] for r in rows)} of {len(rows)} within tolerance")


if __name__ == "__main__":
    main()
