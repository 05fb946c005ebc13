"""FP8 checkpoints as published: which schemes load, how a quantized weight sits in memory, and
its dequantized value.

Two schemes, read from `quantization_config` in config.json:

- `block` (DeepSeek-V3/R1, GLM-5): `quant_method: "fp8"` with `weight_block_size: [bn, bk]` and
  dynamic activations. A quantized `X.weight` is float8_e4m3fn beside a float32
  `X.weight_scale_inv` of [ceil(out / bn), ceil(in / bk)], a multiplier per block (partial blocks
  at the edges).
- `channel` (GLM-4.5/4.6-FP8): compressed-tensors `float-quantized`, weights per output channel
  (`X.weight_scale` [out, 1], a multiplier), activations dynamic per token.

Which weights are quantized is what the checkpoint stores as FP8 (its `ignore` list and the
tensors it keeps in BF16: embedding, LM head, norms, the router gate and its bias).

In memory a quantized weight stays FP8 (1 byte per parameter) and its scale is held per output
row and input block, [rows, ceil(in / bk)] (bk = in for per-channel scales): so a TP slice of
rows, or a merged matrix (q/k/v, gate/up) whose parts end inside a block, needs no block
alignment. A slice of the input features must start and end on a block edge, else the load stops
naming the tensor, the size and the block. A linear's FP8 form is set up before the load
(`prepare_fp8`): every module whose checkpoint weight is FP8 gets an FP8 weight and a scale
parameter, which its own loader fills through `ScaleSource` (the scale tensor read as if it were
the weight: the same row and column slices). MLA's `kv_b_proj` is dequantized once loaded
(`finish_fp8`): its absorbed weights are read as matrices.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


@dataclass(frozen=True)
class Fp8Scheme:
    kind: str
    """"block" or "channel"."""
    block: tuple[int, int] | None = None
    """(rows, input features) of a scale block; None for per-channel scales."""

    def block_shape(self, k: int) -> tuple[int, int]:
        """(rows, input features) one scale covers in a matrix of `k` input features."""
        return self.block if self.kind == "block" else (1, k)


def per_row(scale: torch.Tensor, scheme: Fp8Scheme, rows: int) -> torch.Tensor:
    """A checkpoint's scale [row blocks, K blocks] as held in memory: one row per weight row."""
    return scale.repeat_interleave(scheme.block_shape(1)[0], dim=0)[:rows]


class UnsupportedQuantization(ValueError):
    """A quantization scheme this engine does not load: names the scheme."""


def read_scheme(model_path: str) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme (None: not quantized); UnsupportedQuantization otherwise."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        q = json.load(f).get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _block_scheme(q)
    if method == "compressed-tensors":
        return _channel_scheme(q)
    raise UnsupportedQuantization(
        f"quant_method {method!r} is not supported (fp8 with weight_block_size, or "
        f"compressed-tensors float-quantized per channel)"
    )


def _block_scheme(q: dict) -> Fp8Scheme:
    block = q.get("weight_block_size")
    if q.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedQuantization(f"fp8 fmt {q.get('fmt')!r} is not supported (e4m3)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedQuantization(
            f"fp8 activation_scheme {q.get('activation_scheme')!r} is not supported (dynamic)"
        )
    if not block or len(block) != 2:
        raise UnsupportedQuantization(
            f"fp8 without weight_block_size (per-tensor scales) is not supported; got {block!r}"
        )
    return Fp8Scheme("block", (int(block[0]), int(block[1])))


def _channel_scheme(q: dict) -> Fp8Scheme:
    if q.get("format") != "float-quantized":
        raise UnsupportedQuantization(
            f"compressed-tensors format {q.get('format')!r} is not supported (float-quantized)"
        )
    for name, group in (q.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        acts = group.get("input_activations")
        what = f"compressed-tensors group {name!r}"
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise UnsupportedQuantization(f"{what}: weights {weights} are not FP8")
        if weights.get("strategy") != "channel":
            raise UnsupportedQuantization(
                f"{what}: weight strategy {weights.get('strategy')!r} is not supported (channel)"
            )
        if acts and (not acts.get("dynamic") or acts.get("strategy") != "token"):
            raise UnsupportedQuantization(
                f"{what}: static or non-token activation scales {acts} are not supported "
                f"(dynamic per token)"
            )
    return Fp8Scheme("channel")


def quantize(w: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale in the checkpoint's layout) of a [out, in] matrix: what a
    tiny FP8 checkpoint stores."""
    w = w.float()
    out, k = w.shape
    bn, bk = scheme.block_shape(k)
    rows, cols = -(-out // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:out, :k] = w
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view(rows * bn, cols * bk)[:out, :k].to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int, dtype=torch.float32):
    """w = q x s, with the scale per row (or leading dims) and per `block` input features, as
    held in memory."""
    k = q.shape[-1]
    expanded = scale.repeat_interleave(block, dim=-1)[..., :k]
    return (q.float() * expanded).to(dtype)


def dequantize_checkpoint(q: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme):
    """The float32 weight a checkpoint's FP8 tensor and scale stand for (the tests' reference)."""
    out, k = q.shape
    return dequantize(q, per_row(scale, scheme, out), scheme.block_shape(k)[1])


class ScaleSource:
    """A checkpoint scale tensor read as if it were its weight: `read(0, a, b)` gives weight
    rows [a, b) (a block's scale repeated for each of its rows), `read(1, a, b)` the blocks of
    input features [a, b) for every row. So a module's own loader, which slices its weight,
    slices the scale alike."""

    def __init__(self, source, weight_shape: tuple[int, int], scheme: Fp8Scheme):
        self.source, self.name, self.file = source, source.name, source.file
        self.rows, self.k = weight_shape
        self.bn, self.bk = scheme.block_shape(self.k)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, -(-self.k // self.bk))

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None):
        if dim is None:
            return self._rows(0, self.rows)
        end = end if end is not None else self.shape[dim]
        if dim == 0:
            return self._rows(start, end)
        return self._rows(0, self.rows)[:, self._blocks(start, end)]

    def _rows(self, start: int, end: int) -> torch.Tensor:
        first = start // self.bn
        raw = self.source.read(0, first, -(-end // self.bn)).float()
        raw = raw.view(raw.shape[0], -1)  # a per-channel scale may be stored as [out]
        offset = start - first * self.bn
        return raw.repeat_interleave(self.bn, dim=0)[offset : offset + end - start]

    def _blocks(self, start: int, end: int) -> slice:
        if self.shape[1] == 1:
            return slice(0, 1)  # one scale for the whole row: any slice of it
        if start % self.bk or (end % self.bk and end != self.k):
            raise self.fail(
                f"this rank's slice [{start}, {end}) of the {self.k} input features cuts "
                f"through an FP8 scale block of {self.bk}: choose a TP size that keeps every "
                f"slice on block edges"
            )
        return slice(start // self.bk, -(-end // self.bk))

    def fail(self, message: str):
        return self.source.fail(message)


def prepare_fp8(model: nn.Module, sources: list, map_key, scheme: Fp8Scheme):
    """Give every module whose checkpoint weight is FP8 its FP8 form (`to_fp8`); returns the
    key mapper that also maps the scales, and the FP8 weights' names and shapes."""
    from dserve.models.weights import SKIP

    shapes = {s.name: s.shape for s in sources if s.name.endswith(".weight") and s.is_fp8}
    for name in shapes:
        mapped = map_key(name)
        if mapped is None or mapped is SKIP:
            continue
        module_name, _, attr = mapped[0].rpartition(".")
        module = model.get_submodule(module_name)
        if getattr(module, attr).dtype != FP8:
            to_fp8(module, attr, scheme)

    def map_with_scales(key: str):
        for suffix in SCALE_SUFFIXES:
            if key.endswith(suffix):
                mapped = map_key(key[: -len(suffix)] + ".weight")
                if mapped is None or mapped is SKIP:
                    return mapped
                return mapped[0] + "_scale", mapped[1]
        return map_key(key)

    return map_with_scales, shapes


def scale_source(source, shapes: dict, scheme: Fp8Scheme):
    """`source` as its weight's `ScaleSource` when it is a scale; else itself."""
    for suffix in SCALE_SUFFIXES:
        if source.name.endswith(suffix):
            weight = source.name[: -len(suffix)] + ".weight"
            if weight not in shapes:
                raise source.fail(f"a scale for {weight}, which is not an FP8 tensor")
            return ScaleSource(source, shapes[weight], scheme)
    if source.name.endswith(".input_scale"):
        raise source.fail("static activation scales are not supported (dynamic only)")
    return source


def to_fp8(module: nn.Module, attr: str, scheme: Fp8Scheme) -> None:
    """`module.<attr>` becomes an FP8 weight of the same shape, with `<attr>_scale` [rows,
    input blocks] in float32, both filled by the weight's own loader."""
    dense = getattr(module, attr)
    k = dense.shape[-1]
    bk = scheme.block_shape(k)[1]
    q = nn.Parameter(torch.empty(dense.shape, dtype=FP8, device=dense.device), False)
    shape = (*dense.shape[:-1], -(-k // bk))
    scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=dense.device), False)
    scale.block = bk  # input features per scale column
    for p in (q, scale):
        p.weight_loader = dense.weight_loader
        if hasattr(dense, "expected_shards"):
            p.expected_shards = dense.expected_shards
    setattr(module, attr, q)
    setattr(module, attr + "_scale", scale)
    module.dense_dtype = dense.dtype


def finish_fp8(model: nn.Module) -> None:
    """Once filled: dequantize the weights that are read as matrices rather than multiplied
    (`keep_dense`: MLA's kv_b_proj, whose absorbed halves the attention reads), and hold every
    other FP8 weight's scales row-contiguous (the rows' scales of one K block side by side:
    [..., rows, K blocks] with stride 1 along rows), the layout cuBLAS's blockwise FP8 GEMM
    reads (`kernels/fp8_gemm.py`) and the one a GEMM tile's scale loads coalesce in."""
    for module in model.modules():
        if getattr(module, "keep_dense", False) and module.weight.dtype == FP8:
            scale = module.weight_scale
            dense = dequantize(module.weight, scale, scale.block, module.dense_dtype)
            module.weight = nn.Parameter(dense, requires_grad=False)
            del module.weight_scale
            continue
        for name, scale in list(module.named_parameters(recurse=False)):
            if name.endswith("_scale") and hasattr(scale, "block"):
                setattr(module, name, rows_contiguous(scale))


def rows_contiguous(scale: nn.Parameter) -> nn.Parameter:
    """The same scales with stride 1 along rows (the next-to-last dimension)."""
    held = scale.transpose(-1, -2).contiguous().transpose(-1, -2)
    out = nn.Parameter(held, requires_grad=False)
    out.block = scale.block
    return out


def weight_of(module: nn.Module, attr: str, dtype: torch.dtype, index=None) -> torch.Tensor:
    """`module.<attr>` (or its `index` entry) in `dtype`: dequantized when it is FP8."""
    w = getattr(module, attr)
    if index is not None:
        w = w[index]
    if w.dtype != FP8:
        return w
    scale = getattr(module, attr + "_scale")
    return dequantize(w, scale if index is None else scale[index], scale.block, dtype)


NORM_READERS = {
    "input_layernorm": (
        ("self_attn.fused_qkv_a_proj", "weight"),
        ("self_attn.q_proj", "weight"),
        ("self_attn.qkv_proj", "weight"),
    ),
    "self_attn.q_a_layernorm": (("self_attn.q_b_proj", "weight"),),
    "post_attention_layernorm": (
        ("mlp.experts", "w13"),
        ("mlp.shared_experts.gate_up_proj", "weight"),
        ("mlp.gate_up_proj", "weight"),
    ),
}
"""Per decoder layer, a norm and the linears that read its output (module, weight attribute)."""


def quantize_in_norms(model: nn.Module) -> None:
    """Each norm whose output an FP8 linear reads also quantizes it (`RMSNorm.quant_group`,
    with the Triton kernels): in the scale group of its first FP8 reader. Its other readers
    in the same group take that FP8 form too (the shared and routed experts read one);
    readers in another group quantize for themselves."""
    for layer in model.modules():
        for norm_name, readers in NORM_READERS.items():
            norm = _submodule(layer, norm_name)
            if norm is None:
                continue
            groups = [input_group(_submodule(layer, r), attr) for r, attr in readers]
            norm.quant_group = next((g for g in groups if g), 0)


def input_group(module: nn.Module | None, attr: str) -> int:
    """The activation group an FP8 weight's GEMM quantizes its inputs in (0: not FP8, or a
    weight the FP8 GEMM does not take: `fp8_gemm.supported`, the one rule for both)."""
    w = getattr(module, attr, None)
    if w is None or w.dtype != FP8:
        return 0
    from dserve.kernels.fp8_gemm import supported

    scale = getattr(module, attr + "_scale")
    return scale.block if supported(scale.block, scale.shape[-1]) else 0


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        module = getattr(module, name, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def fp8_linear(x: torch.Tensor, module: nn.Module, attr: str = "weight") -> torch.Tensor:
    """x @ w.T for an FP8 weight: on a GPU the FP8 GEMM (activations quantized per token and
    block on the fly: `kernels/fp8_gemm.py`), else the dequantized product in x's dtype
    (exact in float32)."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        from dserve.kernels.fp8_gemm import fp8_matmul, supported
        from dserve.kernels.triton_fp8 import quantized_form

        w, scale = getattr(module, attr), getattr(module, attr + "_scale")
        if supported(scale.block, scale.shape[-1]):
            found = quantized_form(x, scale.block)
            rows = x.reshape(-1, x.shape[-1])
            y = fp8_matmul(rows, w, scale, scale.block, quantized=found)
            return y.view(*x.shape[:-1], w.shape[0])
    return torch.nn.functional.linear(x, weight_of(module, attr, x.dtype))


def fp8_gated_linear(gate_up: torch.Tensor, module: nn.Module) -> torch.Tensor | None:
    """(SiLU(gate) * up) @ w.T for gate_up [..., 2I] (gate then up) and an FP8 weight on a
    GPU: the activation computed in float32 and quantized in one launch, never stored in
    bf16 (as the fused MoE's down GEMM reads it). None where the FP8 GEMM does not apply."""
    if not gate_up.is_cuda or gate_up.dtype not in (torch.bfloat16, torch.float16):
        return None
    from dserve.kernels.fp8_gemm import quantize_for, quantized_matmul, supported

    w, scale = module.weight, module.weight_scale
    if not supported(scale.block, scale.shape[-1]):
        return None
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    m = rows.shape[0]
    act = quantize_for(rows, scale, scale.block, gated=True)
    y = quantized_matmul(act, m, gate_up.dtype, w, scale, scale.block)
    return y.view(*gate_up.shape[:-1], w.shape[0])


def value_up(o_latent: torch.Tensor, w_uv: torch.Tensor, o_proj: nn.Module) -> torch.Tensor:
    """MLA's attention output [T, H, R] through W_UV [H, V, R] per head, flattened to
    [T, H * V] for o_proj. On a GPU, where o_proj is FP8 in scale groups inside a head, one
    launch that also quantizes the output for o_proj's GEMM (`kernels/triton_value_up.py`);
    else torch's batched product."""
    group = input_group(o_proj, "weight")
    if group and o_latent.is_cuda and o_latent.dtype in (torch.bfloat16, torch.float16):
        from dserve.kernels.triton_value_up import takes, value_up_quantized

        if takes(o_latent.shape[-1], w_uv.shape[1], group):
            return value_up_quantized(o_latent, w_uv, group)
    out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    return out.flatten(1)


def dummy_fp8(model: nn.Module, scheme: Fp8Scheme) -> None:
    """The FP8 form of every linear in the decoder layers and of the routed experts, for random
    weights at real shapes (`quantization="fp8"`, `load_format="dummy"`)."""
    from dserve.models.layers.linear import MergedColumnLinear, ReplicatedLinear, RowParallelLinear
    from dserve.models.layers.moe import Experts

    linear = (MergedColumnLinear, ReplicatedLinear, RowParallelLinear)
    for name, module in list(model.named_modules()):
        if not name.startswith("layers."):
            continue
        if isinstance(module, linear):
            to_fp8(module, "weight", scheme)
        elif isinstance(module, Experts):
            to_fp8(module, "w13", scheme)
            to_fp8(module, "w2", scheme)
