"""Prefill/extend attention: the Triton extend kernels (`dserve.attention.triton_extend`, through the
triton backend) against the torch reference backend, at DeepSeek-V3's MLA shapes (absorbed, 128 or 16
heads, 512 + 64, page 64) and GLM-4.5's GQA shapes (96 heads over 8 KV heads of 128), bf16:

    python -m bench.extend_attention [--cases 2048:0,1024:8192] [--mla-heads 128] [--tune JSON] [--flashinfer]
                                     [--kinds mla,mha]

A case NEW:PREFIX is one span of NEW tokens over PREFIX tokens already in pages. FLOPs count the
causally visible (query, key) pairs; the limit is a large bf16 matmul measured in the same run. Prints
a table and writes JSON. `--tune` takes Triton launch settings (keys of `triton_backend.EXTEND_TUNE`:
rows, block_h, block_n, num_warps, num_stages; under "expanded", those of the expanded MLA kernel),
or a list of them to compare; `--flashinfer` adds FlashInfer's kernels (the flashinfer backend) as
a column. MLA rows also time one layer's attention with the projections each form needs, absorbed
(W_UK, attention over the latents, W_UV) against expanded (`forward_mla_expanded`: the contexts'
latents decompressed through kv_b_proj, then `triton_expanded`'s kernel over 192/128-wide heads),
and that kernel alone (its TFLOPS count 192 + 128 per visible pair and head): the measure behind
`EngineConfig.mla_expand_min_tokens`. Expanded kernel launches, e.g.:

    --kinds mla --cases 4096:0,16384:0 --no-torch --flashinfer
        --tune '[{"expanded": {"rows": 128, "block_n": 64}}, {"expanded": {"rows": 64}}]'
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.cuda_timing import matmul_flops, median_seconds


def span_batch(pool, new: int, prefix: int):
    from dserve.attention.backend import ForwardBatch

    ps, total = pool.layout.page_size, new + prefix
    pages = -(-total // ps)
    table = torch.randperm(pool.num_pages)[:pages].view(1, pages)  # scattered, as in serving
    pos = torch.arange(prefix, total)
    slots = table[0, pos // ps] * ps + pos % ps
    batch = ForwardBatch(
        torch.zeros(new, dtype=torch.int64), pos, [new], [total], table, slots, torch.arange(new)
    )
    return batch.to(torch.device("cuda"))


def run_case(
    kind: str, new: int, prefix: int, heads: int, backends, repeats: int, tune: dict
) -> dict:
    from dserve.memory.kv_pool import KVLayout, KVPool

    ps, dtype, total = 64, torch.bfloat16, new + prefix
    if kind == "mla":
        layout = KVLayout("mla", 1, ps, dtype, latent_dim=576, kv_lora_rank=512)
        shapes, per_pair = (
            ((new, heads, 512), (new, heads, 64), (new, 576)),
            heads * 2 * (576 + 512),
        )
    else:
        layout = KVLayout("mha", 1, ps, dtype, num_kv_heads=8, head_dim=128, v_head_dim=128)
        shapes, per_pair = (
            ((new, heads, 128), (new, 8, 128), (new, 8, 128)),
            heads * 2 * (128 + 128),
        )
    pool = KVPool(layout, -(-total // ps) + 8, "cuda")
    pool.pages.normal_()
    batch = span_batch(pool, new, prefix)
    inputs = [torch.randn(*s, device="cuda", dtype=dtype) for s in shapes]
    flops = per_pair * (new * prefix + new * (new + 1) // 2)
    row = {"kind": kind, "heads": heads, "new": new, "prefix": prefix, "gflop": flops / 1e9}
    for name, cls in backends:
        backend = cls(pool)
        if name == "triton":
            backend.extend_tune[kind].update(
                {k: v for k, v in tune.items() if k in backend.extend_tune[kind]}
            )
            backend.extend_tune["expanded"].update(tune.get("expanded", {}))
        backend.plan(batch)
        forward = backend.forward_mla if kind == "mla" else backend.forward_mha
        seconds = median_seconds(lambda f=forward: f(0, *inputs, 0.1), repeats)
        row[f"{name}_ms"], row[f"{name}_tflops"] = seconds * 1e3, flops / seconds / 1e12
        if kind == "mla" and name == "triton":
            row.update(absorbed_vs_expanded(backend, heads, inputs, repeats, flops / per_pair))
    return row


def absorbed_vs_expanded(backend, heads: int, inputs, repeats: int, pairs: float) -> dict:
    """ms of one MLA layer's attention with the projections each form needs, from q_nope to
    the per-head values: absorbed (q_nope through W_UK, attention over the latents, out
    through W_UV) and expanded (the context's latents decompressed, attention over 192/128-wide
    heads: `forward_mla_expanded`); and the expanded attention alone (`expanded_attention` on
    keys and values decompressed before) with its TFLOPS over the `pairs` visible. A context
    over `mla_expanded.MAX_CONTEXT` stays absorbed: no expanded times."""
    from dserve.attention.mla_expanded import decompress
    from dserve.attention.triton_expanded import expanded_attention

    _, q_rope, latent = inputs
    new = q_rope.shape[0]
    like = dict(device="cuda", dtype=torch.bfloat16)
    q_nope = torch.randn(new, heads, 128, **like)
    kv_b = torch.randn(heads, 256, 512, **like) / 512**0.5  # halves of one weight, as the model's
    w_uk, w_uv = kv_b.split([128, 128], 1)
    plan, launch = backend.expanded_plan(), backend.expanded_launch()
    parts = decompress(backend.pool, 0, plan.slots, w_uk, w_uv, torch.bfloat16)
    settings = {k: v for k, v in launch.items() if k != "rows"}  # rows: the plan's

    def attention():
        args = (q_nope, q_rope, *parts, plan.starts_t, plan.work, 0.1)
        return expanded_attention(*args, **settings)

    def absorbed():
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        out = backend.forward_mla(0, q_latent, q_rope, latent, 0.1)
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))

    def expanded():
        return backend.forward_mla_expanded(0, q_nope, q_rope, latent, w_uk, w_uv, 0.1)

    times = {"absorbed_layer_ms": median_seconds(absorbed, repeats) * 1e3}
    if plan.work is None:
        return times
    attention_ms = median_seconds(attention, repeats) * 1e3
    return times | {
        "expanded_layer_ms": median_seconds(expanded, repeats) * 1e3,
        "expanded_attn_ms": attention_ms,
        "expanded_tflops": pairs * heads * 2 * (192 + 128) / attention_ms / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        type=lambda s: [tuple(int(v) for v in c.split(":")) for c in s.split(",")],
        default=[(1024, 0), (4096, 0), (1024, 8192), (256, 32768)],
    )
    parser.add_argument("--mla-heads", type=int, default=128)
    parser.add_argument(
        "--kinds", type=lambda s: s.split(","), default=["mla", "mha"], help="mla, mha or both"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--no-torch", action="store_true", help="skip the (slow) torch reference backend"
    )
    parser.add_argument(
        "--flashinfer", action="store_true", help="add FlashInfer's kernels as a column"
    )
    parser.add_argument(
        "--tune", type=json.loads, default={}, help="Triton launch settings as JSON, or a list"
    )
    parser.add_argument("--out", default="bench/results/extend_attention.json")
    args = parser.parse_args()
    from dserve.attention.torch_backend import TorchBackend
    from dserve.attention.triton_backend import TritonBackend

    backends = [("triton", TritonBackend)] + ([] if args.no_torch else [("torch", TorchBackend)])
    if args.flashinfer:
        from dserve.attention.flashinfer_backend import FlashInferBackend

        backends.append(("flashinfer", FlashInferBackend))
    tunes = args.tune if isinstance(args.tune, list) else [args.tune]
    peak = matmul_flops()
    print(f"bf16 matmul (8192^3): {peak / 1e12:.0f} TFLOPS")
    others = [name for name, _ in backends[1:]]
    print(
        f"{'kind':>4} {'heads':>5} {'new':>6} {'prefix':>7} {'triton ms':>10} {'TFLOPS':>7} {'of mm':>6} "
        + "".join(f"{name + ' ms':>14}" for name in others)
        + "  tune"
    )
    rows = []
    for tune in tunes:
        kinds = [k for k in (("mla", args.mla_heads), ("mha", 96)) if k[0] in args.kinds]
        for kind, heads in kinds:
            for new, prefix in args.cases:
                try:
                    row = run_case(kind, new, prefix, heads, backends, args.repeats, tune)
                except Exception as e:  # noqa: BLE001 - a setting that does not compile is reported
                    print(
                        f"{kind:>4} {heads:>5} {new:>6} {prefix:>7} failed: {str(e).splitlines()[0][:90]}  "
                        f"{json.dumps(tune)}"
                    )
                    continue
                row.update(of_matmul=row["triton_tflops"] * 1e12 / peak, tune=tune)
                rows.append(row)
                forms = ""
                if "expanded_attn_ms" in row:
                    forms = f"  absorbed layer {row['absorbed_layer_ms']:.3f} ms, expanded "
                    forms += f"{row['expanded_layer_ms']:.3f} ms (attention "
                    forms += f"{row['expanded_attn_ms']:.3f} ms, "
                    forms += f"{row['expanded_tflops']:.0f} TFLOPS)"
                print(
                    f"{kind:>4} {heads:>5} {new:>6} {prefix:>7} {row['triton_ms']:>10.3f} "
                    f"{row['triton_tflops']:>7.1f} {row['of_matmul']:>6.1%} "
                    + "".join(f"{row[name + '_ms']:>14.3f}" for name in others)
                    + f"  {json.dumps(tune)}{forms}",
                    flush=True,
                )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name(), "matmul_tflops": peak / 1e12, "rows": rows},
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
