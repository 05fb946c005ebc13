"""FP8 checkpoints as published: DeepSeek's block layout (scales per 2-D block, partial blocks at
the edges) and GLM-4.5-FP8's compressed-tensors per-channel layout. The engine keeps the weights
FP8 and computes with them dequantized (exact in float32); the reference is transformers in float32
on the same weights dequantized exactly (w = q x s), single rank, TP 2, EP 2, with MTP, and
pipeline stages, and disaggregated. Unsupported schemes and TP slices that cut a scale block stop
the load naming them."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from dserve.models.quant import (
    FP8,
    Fp8Scheme,
    ScaleSource,
    UnsupportedQuantization,
    dequantize,
    dequantize_checkpoint,
    per_row,
    quantize,
    read_scheme,
)
from dserve.models.weights import WeightLoadError
from tests.conftest import random_prompts
from tests.reference import hf_greedy

NEW_TOKENS = 10
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="session")
def fp8_dir(tmp_path_factory):
    """(FP8 checkpoint, its dequantized float32 copy) per (arch, scheme, block, mtp)."""
    made = {}

    def get(arch: str, kind: str, block=(32, 32), mtp: bool = False):
        key = (arch, kind, tuple(block), mtp)
        if key not in made:
            from dserve.models.tiny import make_tiny
            from dserve.models.tiny_fp8 import dequantized_copy

            name = f"{arch}_fp8_{kind}_{block[0]}x{block[1]}{'_mtp' if mtp else ''}"
            out = str(tmp_path_factory.mktemp(name))
            make_tiny(arch, out, mtp=mtp, fp8=kind, fp8_block=block)
            made[key] = (out, dequantized_copy(out, out + "-reference"))
        return made[key]

    return get


def test_block_quantization_round_trips_with_partial_blocks():
    w = torch.randn(48, 80)  # 1.5 row blocks, 2.5 column blocks of 32
    scheme = Fp8Scheme("block", (32, 32))
    q, scale = quantize(w, scheme)
    assert q.dtype == FP8 and scale.shape == (2, 3)
    back = dequantize_checkpoint(q, scale, scheme)
    torch.testing.assert_close(back, w, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits


class Source:
    """A checkpoint tensor in memory, read as TensorSource reads one from disk."""

    def __init__(self, name: str, t: torch.Tensor):
        self.name, self.file, self.t = name, "model.safetensors", t

    @property
    def shape(self):
        return tuple(self.t.shape)

    def read(self, dim=None, start=0, end=None):
        return (
            self.t if dim is None else self.t.narrow(dim, start, (end or self.shape[dim]) - start)
        )

    def fail(self, message: str):
        return WeightLoadError(f"{self.name}: {message}")


def test_scales_slice_with_their_weight():
    """Row slices of any size and column slices on block edges give the scales of exactly that
    part of the weight; a column slice inside a block is refused naming the tensor and sizes."""
    w = torch.randn(48, 96)
    scheme = Fp8Scheme("block", (32, 32))
    q, scale = quantize(w, scheme)
    source = ScaleSource(Source("o_proj.weight_scale_inv", scale), (48, 96), scheme)
    full = dequantize_checkpoint(q, scale, scheme)
    rows = source.read(0, 20, 44)  # cuts the first row block
    torch.testing.assert_close(dequantize(q[20:44], rows, 32), full[20:44], rtol=0, atol=0)
    cols = source.read(1, 32, 96)
    torch.testing.assert_close(dequantize(q[:, 32:], cols, 32), full[:, 32:], rtol=0, atol=0)
    with pytest.raises(WeightLoadError, match=r"o_proj.*\[0, 48\) of the 96 .* block of 32"):
        source.read(1, 0, 48)
    channel = ScaleSource(
        Source("x.weight_scale", torch.rand(48, 1)), (48, 96), Fp8Scheme("channel")
    )
    assert channel.read(1, 0, 48).shape == (48, 1)  # one scale per row: any column slice


def write_config(tmp_path, quantization: dict) -> str:
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({"quantization_config": quantization}, f)
    return str(tmp_path)


@pytest.mark.parametrize(
    "quantization,message",
    [
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "activation_scheme 'static'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {"weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}
                },
            },
            "weight strategy 'tensor' is not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {
                        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                        "input_activations": {"dynamic": False, "strategy": "tensor"},
                    }
                },
            },
            "static or non-token activation scales",
        ),
    ],
)
def test_unsupported_schemes_are_named(quantization, message, tmp_path):
    with pytest.raises(UnsupportedQuantization, match=message):
        read_scheme(write_config(tmp_path, quantization))


CASES = {  # id: (arch, scheme, block, mtp, engine arguments)
    "deepseek-block-1rank-mtp": ("deepseek_v3", "block", (32, 32), True, {}),
    "deepseek-block-tp2": ("deepseek_v3", "block", (32, 16), False, dict(tp_size=2)),
    "deepseek-block-tp2-ep2": ("deepseek_v3", "block", (32, 16), False, dict(tp_size=2, ep_size=2)),
    "glm-channel-1rank": ("glm4_moe", "channel", (32, 32), False, {}),
    "glm-channel-tp2": ("glm4_moe", "channel", (32, 32), False, dict(tp_size=2)),
    "glm-channel-pp2": ("glm4_moe", "channel", (32, 32), False, dict(pp_size=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_gives_the_dequantized_reference_tokens(case, fp8_dir, make_engine):
    arch, kind, block, mtp, kwargs = CASES[case]
    path, reference = fp8_dir(arch, kind, block, mtp)
    engine = make_engine(path, **kwargs)
    prompts = random_prompts(3, engine.model_config.vocab_size, [9, 30, 17], seed=12)
    got = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    for prompt, result in zip(prompts, got):
        assert result.output_ids == hf_greedy(reference, prompt, NEW_TOKENS)
    if mtp:  # the MTP layer is FP8 too: speculation changes nothing
        spec = make_engine(path, speculative_algorithm="mtp", speculative_num_steps=2, **kwargs)
        again = spec.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r.output_ids for r in again] == [r.output_ids for r in got]


def test_weights_stay_fp8_in_memory(fp8_dir, tiny_dir, make_engine):
    """One byte per quantized parameter plus float32 scales; kv_b_proj dequantized at load (MLA
    reads its absorbed halves as matrices); embedding, LM head, norms and router stay dense."""
    path, _ = fp8_dir("deepseek_v3", "block")
    runner = make_engine(path).executor.runner
    params = dict(runner.model.named_parameters())
    assert params["layers.1.mlp.experts.w13"].dtype == FP8
    assert params["layers.1.mlp.experts.w13_scale"].dtype == torch.float32
    assert params["layers.0.self_attn.o_proj.weight"].dtype == FP8
    assert params["layers.0.self_attn.fused_qkv_a_proj.weight"].dtype == FP8
    assert params["layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float32
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.1.mlp.gate_weight"):
        assert params[name].dtype == torch.float32
    dense = make_engine(tiny_dir("deepseek_v3")).executor.runner.parameter_bytes
    assert runner.parameter_bytes < 0.6 * dense


def test_norms_quantize_for_their_fp8_readers(fp8_dir, tiny_dir, make_engine):
    """With the Triton kernels, a norm read by FP8 linears quantizes its output in their
    scale group (`quantize_in_norms`): the input norm for q_a + kv_a, the q-LoRA norm for
    q_b, the post-attention norm for the dense MLP or the shared and routed experts. The
    latent's norm feeds no GEMM, and a BF16 model's norms quantize nothing."""
    from dserve.models.quant import quantize_in_norms

    path, _ = fp8_dir("deepseek_v3", "block", (32, 32))
    model = make_engine(path).executor.runner.model
    quantize_in_norms(model)
    for layer in model.layers:  # layer 0 dense, the others MoE
        attn = layer.self_attn
        assert layer.input_layernorm.quant_group == 32
        assert attn.q_a_layernorm.quant_group == 32
        assert layer.post_attention_layernorm.quant_group == 32
        assert attn.kv_a_layernorm.quant_group == 0
    dense = make_engine(tiny_dir("deepseek_v3")).executor.runner.model
    quantize_in_norms(dense)
    groups = {m.quant_group for m in dense.modules() if hasattr(m, "quant_group")}
    assert groups == {0}


def test_a_tp_split_through_a_block_is_refused(fp8_dir, make_engine):
    """Blocks of 32 input features and TP 2: o_proj's 96 inputs split at 48, inside a block."""
    path, _ = fp8_dir("deepseek_v3", "block", (32, 32))
    match = r"o_proj.*\[(0, 48|48, 96)\) of the 96 input features .* block of 32"
    with pytest.raises(Exception, match=match):
        make_engine(path, tp_size=2)


@pytest.mark.slow
def test_disaggregated_fp8_pair(fp8_dir, tmp_path):
    """Prefill TP 2 and decode TP 1 on the same FP8 checkpoint (the KV stays in the model's
    dtype): the reference tokens through the router, no page left used."""
    pytest.importorskip("ucxx")
    from tests.servers import check_and_stop, start_cluster

    path, reference = fp8_dir("deepseek_v3", "block", (32, 16))
    cluster = start_cluster(path, tmp_path, ["--tp", "2"], [])
    prompts = random_prompts(2, 512, [12, 31], seed=2)
    check_and_stop(cluster, prompts, lambda ids: hf_greedy(reference, ids, NEW_TOKENS), GREEDY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind,block", [("block", 32), ("block", 128), ("channel", None)])
def test_fp8_gemm_against_the_dequantized_product(kind, block):
    """The FP8 GEMMs (Triton's, whole K or split, and cuBLAS's where it takes the weight)
    within one e4m3 rounding of the activations (2^-4) of the float32 product with the dequantized weight,
    partial blocks at the edges of N and K included, scales row- or column-major, token counts
    cuBLAS pads."""
    from dserve.kernels.fp8_gemm import CUBLAS, TRITON_DEFAULTS, cublas_takes, fp8_matmul
    from tests.reference import relative_error

    gen = torch.Generator().manual_seed(4)
    ran = set()
    for n, k in ((100, 96), (256, 320), (72, 1024), (128, 512)):
        scheme = Fp8Scheme("block", (block, block)) if kind == "block" else Fp8Scheme("channel")
        q, scale = quantize(torch.randn(n, k, generator=gen) / k**0.5, scheme)
        bk = scheme.block_shape(k)[1]
        rows = per_row(scale, scheme, n).contiguous().cuda()
        q = q.cuda()
        dense = dequantize(q, rows, bk)
        backends = {
            "triton": TRITON_DEFAULTS[16],
            "triton split-K": {**TRITON_DEFAULTS[64], "SPLIT_K": 3},
        }
        if cublas_takes(n, k, bk, rows.shape[1] == 1, q.device):
            backends["cublas"] = CUBLAS
        for (name, config), layout in itertools.product(backends.items(), ("row", "column")):
            held = rows if layout == "row" else rows.t().contiguous().t()
            for m in (1, 17, 300):
                x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
                got = fp8_matmul(x, q, held, bk, config)
                assert got.shape == (m, n)
                assert relative_error(got, x.float() @ dense.T) < 2**-4, (name, n, k, m)
            ran.add(name)
    hopper = torch.cuda.get_device_capability()[0] == 9
    if hopper and block != 32:
        assert ran == {"triton", "triton split-K", "cublas"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_engine_on_gpu(fp8_dir, make_engine):
    """float32 on the GPU dequantizes: the reference tokens exactly. bf16 runs the FP8 GEMMs,
    which round every GEMM's input to e4m3 (up to 2^-4 relative, 2^-4 / sqrt(3) rms): with 19
    such inputs on the way (five linears in each of three layers, the routed experts' two
    W8A8 GEMMs in each of the two MoE layers) the logits' error, independent roundings adding
    up, stays within twice 2^-4 x sqrt(19 / 3)."""
    from dserve.scheduler.scheduler import Span
    from tests.conftest import forward_spans
    from tests.reference import hf_last_logits, relative_error

    path, reference = fp8_dir("deepseek_v3", "block", (32, 32))
    exact = make_engine(path, device="cuda", dtype="float32", max_total_tokens=2048)
    prompts = random_prompts(2, 512, [9, 30], seed=12)
    for prompt, result in zip(prompts, exact.generate(input_ids=prompts, sampling_params=GREEDY)):
        assert result.output_ids == hf_greedy(reference, prompt, NEW_TOKENS)
    bf16 = make_engine(path, device="cuda", max_total_tokens=2048)
    req = bf16.make_request(input_ids=prompts[1], sampling_params=GREEDY)
    bf16.groups[0].kv.allocate_slots(req.rid, req.num_tokens)
    logits = forward_spans(bf16, [Span(req, 0, req.num_tokens)])
    bf16.groups[0].kv.free(req.rid)
    bound = 2 * 2**-4 * (19 / 3) ** 0.5
    assert relative_error(logits[0], hf_last_logits(reference, prompts[1])) < bound


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("shape", [dict(tp_size=2), dict(tp_size=2, ep_size=2)])
@pytest.mark.parametrize(
    "arch,kind,block", [("deepseek_v3", "block", (32, 16)), ("glm4_moe", "channel", (32, 32))]
)
def test_fp8_split_over_gpus(fp8_dir, make_engine, shape, arch, kind, block):
    """FP8 under TP 2 and EP 2 over NCCL. float32 dequantizes: the reference tokens exactly. bf16
    computes with each rank's slice and its scales (the per-channel layout through the FP8 GEMM,
    whose per-token activation scales then cover each rank's half of a row-parallel input; blocks
    of 16 input features, which TP 2 needs at these tiny shapes, dequantized): the first token's
    top log-probabilities are no further from the exact ones (float32, dequantized) than twice
    the one-GPU bf16 FP8 engine's own distance from them, plus 0.02 nats (bf16's rounding)."""
    path, reference = fp8_dir(arch, kind, block)
    kwargs = dict(device="cuda", max_total_tokens=2048)
    prompts = random_prompts(3, 512, [9, 30, 71], seed=13)
    exact = make_engine(path, dtype="float32", **kwargs, **shape)
    for prompt, result in zip(prompts, exact.generate(input_ids=prompts, sampling_params=GREEDY)):
        assert result.output_ids == hf_greedy(reference, prompt, NEW_TOKENS)
    params = dict(GREEDY, max_new_tokens=1, return_logprob=True, top_logprobs_num=5)

    def top(engine) -> list[dict]:
        results = engine.generate(input_ids=prompts, sampling_params=params)
        return [dict(r.meta["output_top_logprobs"][0]) for r in results]

    want = top(exact)
    split = top(make_engine(path, **kwargs, **shape))
    alone = top(make_engine(path, **kwargs))

    def distance(got: list[dict]) -> float:
        return max(abs(g[t] - w[t]) for g, w in zip(got, want) for t in set(g) & set(w))

    assert all(len(set(g) & set(w)) >= 3 for g, w in zip(split, want)), (split, want)
    assert distance(split) <= 2 * distance(alone) + 0.02, (split, alone, want)
