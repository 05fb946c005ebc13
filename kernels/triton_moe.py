"""Triton fused MoE: the routed experts of a batch as two grouped GEMMs, with no host sync.

The (token, slot) pairs are sorted by expert on the device (`triton_routing.sort_pairs`) into a
buffer of static size (each expert's run padded to a multiple of BLOCK_M, pairs of experts this
rank does not hold left out), so the launch shape depends only on the batch size: a CUDA graph
can hold it. Each program takes one BLOCK_M run of one expert and a BLOCK_N slice of the output:
gate/up for every pair, then SiLU(gate) * up, then down scaled by the pair's routing weight; the
slots of a token are summed last.
Same arithmetic as `models.layers.moe.Experts.forward` up to rounding (float32 accumulation, one
rounding to the activation dtype per GEMM). FP8 experts (`models/quant.py`) are read as FP8, one
byte per weight. With bf16/fp16 activations the GEMMs are W8A8, as for the FP8 linears: each
GEMM's input is quantized per token and K block (`triton_fp8.quantize_activations`: a separate
launch measured faster than quantizing in the GEMM's program, which stalls its pipelined loads),
the tensor cores multiply FP8 tiles, and each K block's product is scaled by the token's and the
weight row's scales. With float32 activations (or scale blocks under 32) the GEMMs are
weight-only: the program widens the e4m3 weights to the activations' dtype (exactly) and scales
each K block's product by the weight rows' scales (float32's rounding against the dequantized
reference).

Launch parameters (row block, BLOCK_N, warps, stages) come per dtype, expert shape and token count from
the table `bench.moe_gemm --sweep --write` measures (`moe_gemm_configs.json` beside this file),
keyed by how many experts this rank holds; shapes it lacks take the defaults.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dserve.kernels import launch_table
from dserve.kernels.triton_fp8 import QuantizedRows, quantize_activations
from dserve.kernels.triton_routing import pairs_bound, sort_pairs


@triton.jit(do_not_specialize=["num_pairs", "stride_ask"])
def _grouped_gemm(
    a_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    block_expert_ptr,
    scale_ptr,
    ws_ptr,
    as_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_asm,
    stride_ask,
    group_k,
    FP8: tl.constexpr,
    W8A8: tl.constexpr,
    TOP_K: tl.constexpr,
    ROWS_PER_TOKEN: tl.constexpr,
    SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # offsets past 2**31
    if expert >= 0:
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < num_pairs
        row = pair // TOP_K if ROWS_PER_TOKEN else pair
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_ptr + row[:, None] * stride_am + offs_k[None, :],
                mask=valid[:, None] & (offs_k[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr
                + expert * stride_we
                + offs_n[None, :] * stride_wn
                + offs_k[:, None] * stride_wk,
                mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
                other=0.0,
            )
            if FP8:  # this K block's scale of each output row
                s = tl.load(
                    ws_ptr
                    + expert * stride_wse
                    + offs_n * stride_wsn
                    + (k0 // group_k) * stride_wsk,
                    mask=offs_n < N,
                    other=0.0,
                )
                if W8A8:  # and of each token
                    a_s = tl.load(
                        as_ptr + row * stride_asm + (k0 // group_k) * stride_ask,
                        mask=valid,
                        other=0.0,
                    )
                    acc += tl.dot(a, w) * (a_s[:, None] * s[None, :])
                else:  # e4m3 values are exact in a's dtype: the scales come after
                    w = w.to(a.dtype)
                    acc += tl.dot(a, w, input_precision=PRECISION) * s[None, :]
            else:
                acc += tl.dot(a, w, input_precision=PRECISION)
        if SCALE:
            acc *= tl.load(scale_ptr + pair, mask=valid, other=0.0)[:, None]
        tl.store(
            out_ptr + pair[:, None] * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & (offs_n[None, :] < N),
        )


CONFIGS = os.path.join(os.path.dirname(__file__), "moe_gemm_configs.json")


def table_key(dtype: str, hidden: int, inter: int, experts: int) -> str:
    """The table's key of this rank's experts: "fp8:7168x2048:e32" (inter: this rank's share
    of the intermediate size, experts: how many this rank holds)."""
    return f"{dtype}:{hidden}x{inter}:e{experts}"


def launch_choice(dtype: str, hidden: int, inter: int, experts: int, tokens: int) -> dict:
    """The table's launch parameters (block_m, block_n, num_warps, num_stages) for the
    smallest measured token count >= `tokens` (the largest measured one beyond them); {} where
    the shape was not measured."""
    entries = launch_table.read(CONFIGS).get(table_key(dtype, hidden, inter, experts), {})
    if not entries:
        return {}
    counts = sorted(int(m) for m in entries)
    fitting = [m for m in counts if m >= tokens] or counts[-1:]
    return dict(entries[str(fitting[0])])


def default_block_m(pairs: int, num_experts: int) -> int:
    """Rows per program: twice the mean pairs per expert, a power of two in [16, 128] (from
    `pairs_bound`'s count, so a token-count bucket has one choice). A program reads
    its expert's weights once per row block, so an expert should mostly fit one block; the choice
    depends on shapes only (a CUDA graph keeps it)."""
    want = max(16, min(128, 2 * pairs // max(num_experts, 1)))
    return 1 << (want - 1).bit_length()


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first: int = 0,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int = 64,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8_block: int = 0,
    quantized: QuantizedRows | None = None,
    **launch_options,
) -> torch.Tensor:
    """sum over slots s of weights[t, s] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)), e = ids[t, s], for
    the experts held here (w13 [E, 2I, H] gate then up, w2 [E, H, I], experts first .. first+E-1).
    FP8 weights come with `scales` (w13's and w2's, [E, rows, K blocks]) of `fp8_block` inputs;
    `quantized`: x's FP8 form in w13's groups where a norm made it (else x is quantized here).
    `launch_options`: Triton's num_warps / num_stages for both GEMMs; with none of them,
    `block_m` and `block_n` given, the table's choice."""
    tokens, top_k = ids.shape
    num_local, two_i, hidden = w13.shape
    n = tokens * top_k
    if n == 0:
        return torch.zeros_like(x)
    if block_m is None and block_n is None and not launch_options:
        kind = "fp8" if scales is not None else "bf16"
        launch_options = launch_choice(kind, hidden, two_i // 2, num_local, tokens)
    block_m = launch_options.pop("block_m", block_m) or default_block_m(pairs_bound(ids), num_local)
    block_n = launch_options.pop("block_n", block_n) or 64
    pairs, block_expert = sort_pairs(ids, first, num_local, block_m)
    gate_up = torch.empty(n, two_i, dtype=x.dtype, device=x.device)
    down = torch.zeros(n, hidden, dtype=x.dtype, device=x.device)
    scale = weights.reshape(-1).float().contiguous()
    fp8 = scales is not None
    per_channel = fp8 and scales[0].shape[-1] == 1
    if fp8 and not per_channel:
        block_k = min(128, fp8_block)  # one scale per K tile
    w8a8 = fp8 and x.dtype != torch.float32 and (per_channel or fp8_block >= 32)

    def k_group(K: int) -> int:  # inputs per scale
        return K if per_channel else max(fp8_block, 1)

    def launch(a, w, out, rows_per_token, use_scale, N, K, ws, a_s=None):
        if w8a8 and a_s is None:
            a, a_s = quantize_activations(a, k_group(K))
        a_s = scale if a_s is None else a_s  # any tensor: not read
        ws = ws if fp8 else scale
        grid = (block_expert.numel(), triton.cdiv(N, block_n))
        _grouped_gemm[grid](
            a,
            w,
            out,
            pairs,
            block_expert,
            scale,
            ws,
            a_s,
            n,
            N,
            K,
            a.stride(0),
            w.stride(0),
            w.stride(1),
            w.stride(2),
            out.stride(0),
            ws.stride(0),
            ws.stride(1) if fp8 else 0,
            ws.stride(2) if fp8 else 0,
            a_s.stride(0),
            a_s.stride(1) if w8a8 else 0,
            k_group(K),
            FP8=fp8,
            W8A8=w8a8,
            TOP_K=top_k,
            ROWS_PER_TOKEN=rows_per_token,
            SCALE=use_scale,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32 stays exact
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            **launch_options,
        )

    ws13, ws2 = scales if fp8 else (None, None)
    if w8a8 and quantized is not None and quantized.serves(k_group(hidden)):
        x_in, x_scales = quantized.q, quantized.scales
    else:
        x_in, x_scales = x.contiguous(), None
    launch(x_in, w13, gate_up, True, False, two_i, hidden, ws13, x_scales)
    inter = two_i // 2
    if w8a8:  # SiLU(gate) * up quantized in one pass
        act, act_s = quantize_activations(gate_up, k_group(inter), gated=True)
        launch(act, w2, down, False, True, hidden, inter, ws2, act_s)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = (F.silu(gate) * up).contiguous()
        launch(act, w2, down, False, True, hidden, inter, ws2)
    return down.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
