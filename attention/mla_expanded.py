"""MLA in its expanded (non-absorbed) form, as prefills run it (SGLang and vLLM do the same):
each context token's latent is decompressed through kv_b_proj into per-head keys (the no-RoPE
part; the RoPE key is the latent's own, shared by every head) and values, and the span's queries
attend over them causally.

For a long prompt chunk this costs far fewer FLOPs than the absorbed form: attention over
192-wide keys and 128-wide values per head instead of the 576-wide latent and 512-wide output,
plus the decompression (one GEMM of the contexts' latents). For a few new tokens over a long
context the decompression dominates, so only spans of at least
`EngineConfig.mla_expand_min_tokens` new tokens expand; the pass's other spans stay absorbed
(`AttentionBackend.forward_mla_expanded`). `plan_expanded` picks the spans once a pass;
`expanded_mla` decompresses all their contexts at once and attends with the fused Triton kernel
(`triton_expanded`, on a GPU and under the interpreter) or PyTorch's attention (the reference).

Measured on an H100 (`bench.extend_attention`, 128 heads, bf16), before the Triton kernel:
PyTorch's attention with the lower-right causal mask and 192/128-wide heads took its math path
(64.9 ms for a 4k-token prompt against 17.5 ms absorbed; a 16k prompt ran out of memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from dserve.memory.kv_pool import KVPool

MAX_CONTEXT = 32768
"""Most context tokens a pass expands, its expanded spans together: their per-head keys and
values are materialised (at 128 heads, 32k tokens: 2.1 GB in bf16); a span that would go past
it stays absorbed."""


@dataclass
class ExpandedPlan:
    """A pass's expanded spans and where their contexts are (made once a pass)."""

    batch: object  # the ForwardBatch it was made for
    spans: list[int]  # the spans expanded
    slots: torch.Tensor  # int64 [S]: their contexts' cache slots, span after span
    starts: list[int]  # per span of the batch, where its context starts in `slots`
    rows: int | None = None  # the Triton kernel's tokens a program (None: PyTorch's attention)
    work: object = None  # the kernel's work blocks, a `triton_extend.ExtendPlan`
    starts_t: torch.Tensor | None = None  # int32 [B]: `starts` on the device
    rest: object = None  # a ForwardBatch of the other spans (absorbed), if any
    rest_rows: torch.Tensor | None = None  # their rows in the pass


def expanded_spans(batch, min_tokens: int) -> list[int]:
    """The spans of at least `min_tokens` new tokens, in order, while their contexts together
    stay within `MAX_CONTEXT`."""
    spans, total = [], 0
    for i, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens)):
        if q_len >= max(1, min_tokens) and total + seq_len <= MAX_CONTEXT:
            spans.append(i)
            total += seq_len
    return spans


def plan_expanded(batch, page_size: int, min_tokens: int, rows: int | None) -> ExpandedPlan:
    """The plan of `batch`'s spans of at least `min_tokens` new tokens; `rows`: the Triton
    kernel's tokens a program (None: PyTorch's attention)."""
    spans = expanded_spans(batch, min_tokens)
    chosen = set(spans)
    lens = [n if i in chosen else 0 for i, n in enumerate(batch.seq_lens)]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    slots = context_slots(batch, spans, page_size)
    plan = ExpandedPlan(batch, spans, slots, starts, rows)
    if rows is not None and spans:
        from dserve.attention.triton_expanded import plan_blocks

        device = batch.page_table.device
        plan.work = plan_blocks(batch.q_lens, batch.seq_lens, spans, rows, device)
        plan.starts_t = torch.tensor(starts, dtype=torch.int32).to(device)
    if len(spans) < len(batch.q_lens):
        rest = [i for i in range(len(batch.q_lens)) if i not in chosen]
        plan.rest, plan.rest_rows = batch.select(rest)
    return plan


def context_slots(batch, spans: list[int], page_size: int) -> torch.Tensor:
    """The cache slots of `spans`' whole contexts, span after span."""
    lens = torch.tensor([batch.seq_lens[i] for i in spans], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.tensor(spans, dtype=torch.int64), lens)
    pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    owner, pos = owner.to(batch.page_table.device), pos.to(batch.page_table.device)
    return batch.page_table[owner, pos // page_size] * page_size + pos % page_size


def kv_weight(w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """kv_b_proj's weight [H * (N + V), R] whose halves are w_uk [H, N, R] and w_uv [H, V, R]:
    a view where they are views of it (as the model's are), else a copy."""
    heads, nope, rank = w_uk.shape
    joint = (heads, nope + w_uv.shape[1], rank)
    strides = (joint[1] * rank, rank, 1)
    adjacent = (
        w_uk.stride() == w_uv.stride() == strides
        and w_uv.untyped_storage().data_ptr() == w_uk.untyped_storage().data_ptr()
        and w_uv.data_ptr() == w_uk.data_ptr() + nope * rank * w_uk.element_size()
    )
    joined = w_uk.as_strided(joint, strides) if adjacent else torch.cat([w_uk, w_uv], 1)
    return joined.view(-1, rank)


def decompress(pool: KVPool, layer: int, slots: torch.Tensor, w_uk, w_uv, dtype):
    """The contexts at `slots`: keys' no-RoPE part [S, H, N] and values [S, H, V] (views of
    one GEMM through kv_b_proj), and the RoPE key [S, P], every head's (a view of the latents)."""
    latents = pool.read(layer, 0, slots).to(dtype)  # [S, R + P]
    heads, nope, rank = w_uk.shape
    kv = latents[:, :rank] @ kv_weight(w_uk, w_uv).T
    kv = kv.view(len(slots), heads, nope + w_uv.shape[1])
    return kv[..., :nope], latents[:, rank:], kv[..., nope:]


def reference_attention(q_nope, q_rope, k_nope, k_rope, values, plan, scale) -> torch.Tensor:
    """`triton_expanded.expanded_attention` through PyTorch's attention, span by span."""
    b, heads = plan.batch, q_nope.shape[1]
    out = q_nope.new_empty(q_nope.shape[0], heads, values.shape[-1])
    for span in plan.spans:
        q_len, seq_len = b.q_lens[span], b.seq_lens[span]
        row = sum(b.q_lens[:span])
        rows, ctx = slice(row, row + q_len), slice(plan.starts[span], plan.starts[span] + seq_len)
        q = torch.cat([q_nope[rows], q_rope[rows]], -1).transpose(0, 1)
        k_pe = k_rope[ctx, None].expand(-1, heads, -1)
        keys = torch.cat([k_nope[ctx], k_pe], -1).transpose(0, 1)  # [H, S, N + P]
        mask = causal_lower_right(q_len, seq_len)
        o = F.scaled_dot_product_attention(
            q, keys, values[ctx].transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[rows] = o.transpose(0, 1)
    return out


def expanded_mla(
    pool: KVPool,
    plan: ExpandedPlan,
    layer: int,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    launch: dict | None = None,
) -> torch.Tensor:
    """q_nope [T, H, N], q_rope [T, H, P], w_uk [H, N, R], w_uv [H, V, R] -> [T, H, V],
    written on the plan's spans' rows: each span's tokens (its last q_len context positions)
    over its context, causally. The new tokens' latents must be in `pool` already. `launch`:
    the Triton kernel's settings (the plan made with its rows), None for PyTorch's attention."""
    parts = decompress(pool, layer, plan.slots, w_uk, w_uv, q_nope.dtype)
    if plan.work is None:  # PyTorch's attention, or no span
        return reference_attention(q_nope, q_rope, *parts, plan, scale)
    from dserve.attention.triton_expanded import expanded_attention

    settings = {k: v for k, v in launch.items() if k != "rows"}
    return expanded_attention(q_nope, q_rope, *parts, plan.starts_t, plan.work, scale, **settings)
