"""Compile Triton kernels for an H100 (sm_90) on a host without a GPU.

Triton's interpreter, which the CPU tests run the kernels in, accepts code a GPU compile refuses
(session 23: a jit function returning tensors of two shapes from two constexpr branches passed
every CPU test, then failed to compile on the H100). Here the kernels' own Python wrappers are
called with CPU tensors while `JITFunction.run` is replaced: each launch is typed from its
arguments and taken through Triton's front end for sm_90 (the code generator, where type and
shape errors such as a dot narrower than 16 are raised; the later LLVM and ptxas stages are left
out: on the 2-core CI host they take minutes), not run.

    python -m tests.tools.gpu_compile      # prints one line per kernel variant, exit 1 on a failure

Gluon kernels (`attention/gluon_mla.py`; Gluon has no interpreter, so nothing else on a CPU
host runs them) go through Triton's whole compiler instead, to sm_90 code, with a stand-in driver
that names an H100 as the target, in a fresh cache so that ptxas runs on each: a variant whose
wgmma ptxas serializes fails (its C7511 note; session 53's seesaw with loader warps ran 2x
slower for it, with no spill and no warning).

Must start without TRITON_INTERPRET (the kernels are then `JITFunction`s).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
}
TARGET = GPUTarget("cuda", 90, 32)
LAUNCH = JITFunction.run  # Triton's own launch (Gluon kernels compile through it)


class H100Driver:
    """Stands in for the CUDA driver while a Gluon kernel compiles: device 0, an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET

    def get_active_torch_device(self):
        return torch.device("cpu")


class Compiler:
    """Stands in for `JITFunction.run`: compiles each new variant, records failures."""

    def __init__(self):
        self.seen: set = set()
        self.failures: list[str] = []
        self.compiled = 0
        self.gluon_kernels: set = set()
        self.ptxas_seen: set = set()  # Gluon kernels whose ptxas log was read

    def run(self, fn: JITFunction, *args, grid, warmup, **kwargs):
        if getattr(fn, "is_gluon", lambda: False)():
            return self.gluon(fn, args, kwargs)
        signature, constants = typed(fn, args, kwargs)
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        key = (fn.fn.__qualname__, repr(sorted(constants.items())), repr(signature), repr(options))
        if key in self.seen:
            return None
        self.seen.add(key)
        name = f"{fn.fn.__name__} {shown(constants)} {options}"
        try:
            front_end(ASTSource(fn, signature, constants), options)
            self.compiled += 1
        except Exception as e:  # noqa: BLE001 - reported, then the next variant
            cause = e.__cause__ or e
            self.failures.append(f"{name}: {str(cause)[-1500:]}")
        return None

    def gluon(self, fn: JITFunction, args, kwargs):
        """A Gluon launch compiled to sm_90 code by Triton's own pipeline (not run)."""
        import triton

        name = f"{fn.fn.__name__} (gluon) {shown(typed(fn, args, kwargs)[1])}"
        drivers = triton.runtime.driver
        before = drivers._active  # none on a CPU host: the default would fail to load
        drivers.set_active(H100Driver())
        try:
            log = ptxas_log(lambda: LAUNCH(fn, *args, grid=(1,), warmup=True, **kwargs))
            self.compiled += 1
            self.gluon_kernels.add(fn.fn.__name__)
            if "registers" in log:  # ptxas ran (a variant compiled before is cached)
                self.ptxas_seen.add(fn.fn.__name__)
            serialized = [line for line in log.splitlines() if "C7511" in line]
            if serialized:
                self.failures.append(f"{name}: ptxas serialized its wgmma: {serialized[0]}")
        except Exception as e:  # noqa: BLE001 - reported, then the next variant
            causes = [e]
            while causes[-1].__cause__ is not None:
                causes.append(causes[-1].__cause__)
            said = " <- ".join(str(c)[-600:] for c in causes[1:] or causes)
            self.failures.append(f"{name}: {said}")
        finally:
            drivers._active = before


def ptxas_log(compile_) -> str:
    """What ptxas said while `compile_()` ran (Triton prints its log when asked)."""
    from triton import knobs

    said = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(said):
        knobs.nvidia.dump_ptxas_log = True
        compile_()
    return said.getvalue()


def front_end(src: ASTSource, options: dict) -> None:
    """Triton IR of `src` for TARGET: what `triton.compile` does before its lowering stages."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    backend = make_backend(TARGET)
    parsed = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(parsed)
    src.make_ir(TARGET, parsed, codegen, backend.get_module_map(), context)


def typed(fn: JITFunction, args, kwargs) -> tuple[dict, dict]:
    """(signature, constexpr values) of a launch, from its arguments."""
    bound = dict(zip(fn.arg_names, args))
    bound.update(kwargs)
    signature, constants = {}, {}
    for param in fn.params:
        value = bound.get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + DTYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name], constants[param.name] = "constexpr", value
    return signature, constants


def shown(constants: dict) -> dict:
    return {k: v for k, v in constants.items() if k.isupper() and not callable(v)}


def extend_launches(gen: torch.Generator) -> None:
    """The extend kernels (MLA absorbed, MHA/GQA, expanded MLA), causal and with a tree."""
    from dserve.attention.triton_expanded import expanded_attention, plan_blocks
    from dserve.attention.triton_extend import mha_extend, mla_extend, plan_extend

    q_lens, seq_lens, page = [40, 3], [100, 20], 16
    tokens, pages = sum(q_lens), 16
    table = torch.arange(pages, dtype=torch.int32).view(2, -1)
    trees = [None, [None, _tree(3)]]  # causal only; a draft tree in the second span
    bf16 = dict(dtype=torch.bfloat16)
    for masks in trees:
        plan = plan_extend(q_lens, seq_lens, masks, 64, "cpu")
        cache = torch.randn(pages, page, 576, generator=gen).to(**bf16)
        mla_extend(
            torch.randn(tokens, 128, 512).to(**bf16),
            torch.randn(tokens, 128, 64).to(**bf16),
            cache,
            table,
            plan,
            0.1,
        )
        k = torch.randn(pages, page, 8, 128).to(**bf16)
        mha_extend(torch.randn(tokens, 64, 128).to(**bf16), k, k.clone(), table, plan, 0.1,
                   block_n=64, num_warps=8, num_stages=3, block_g=1)  # fmt: skip
    plan = plan_blocks(q_lens, seq_lens, [0, 1], 128, "cpu")
    ctx = sum(seq_lens)
    kv = torch.randn(ctx, 16, 256).to(**bf16)
    expanded_attention(torch.randn(tokens, 16, 128).to(**bf16),
                       torch.randn(tokens, 16, 64).to(**bf16), kv[..., :128],
                       torch.randn(ctx, 64).to(**bf16), kv[..., 128:],
                       torch.tensor([0, seq_lens[0]], dtype=torch.int32), plan, 0.1,
                       num_stages=3)  # fmt: skip


def dsa_and_norm_launches(gen: torch.Generator) -> None:
    """The DSA indexer's scores and top-k, and the RMSNorm that quantizes for FP8 GEMMs."""
    from dserve.attention.index_cache import key_scales
    from dserve.attention.triton_dsa import indexer_scores
    from dserve.attention.triton_topk import select_top_triton
    from dserve.kernels.triton_norm import rms_norm
    from dserve.memory.kv_pool import KVLayout, KVPool

    keys = torch.randn(8, 64, 128, generator=gen).to(torch.bfloat16)
    table = torch.arange(8, dtype=torch.int32).view(1, -1)
    q = torch.randn(2, 32, 128).to(torch.bfloat16)
    rows, lens = torch.zeros(2, dtype=torch.int32), torch.tensor([300, 512], dtype=torch.int32)
    indexer_scores(q, torch.randn(2, 32), keys, table, rows, lens, 0.1, 512)
    fp8 = KVPool(KVLayout("index", 1, 64, torch.uint8, latent_dim=128), 8, "cpu").buffers[0]
    scales = key_scales(fp8[1])  # FP8 keys: a page's keys, then their scales
    indexer_scores(q, torch.randn(2, 32), fp8[0], table, rows, lens, 0.1, 512, key_scales=scales)
    select_top_triton(torch.randn(2, 4096), 2048)
    select_top_triton(torch.randn(2, 4096), 2048, torch.tensor([4096, 100]))
    x = torch.randn(3, 7168).to(torch.bfloat16)
    rms_norm(x, torch.ones(7168).to(torch.bfloat16), 1e-6, x.clone(), quant_group=128)


def decode_and_gemm_launches(gen: torch.Generator) -> None:
    """MLA decode (over contexts and over selected positions; TMA needs a GPU), MHA decode,
    the FP8 quantization and GEMM (whole K and split), MLA's value up-projection that
    quantizes for o_proj, the fused MoE in BF16 and FP8, and the page gather of FlashInfer's
    page lists."""
    from dserve.attention.triton_mha import mha_decode
    from dserve.attention.triton_mla import mla_decode
    from dserve.attention.triton_pages import gather_pages
    from dserve.kernels.triton_fp8 import quantize_activations, triton_matmul
    from dserve.kernels.triton_moe import fused_experts
    from dserve.kernels.triton_value_up import value_up_quantized

    bf16, i32 = torch.bfloat16, torch.int32
    cache = torch.randn(8, 64, 576, generator=gen).to(bf16)
    table, lens = torch.arange(8, dtype=i32).view(2, -1), torch.tensor([200, 256], dtype=i32)
    q, qr = torch.randn(2, 64, 512).to(bf16), torch.randn(2, 64, 64).to(bf16)
    mla_decode(q, qr, cache, table, lens, 0.1, max_len=256)
    mla_decode(q, qr, cache, table, lens, 0.1, max_len=256, both_halves=True, block_h=64)
    chosen = torch.randint(0, 256, (2, 128), generator=gen)
    mla_decode(q, qr, cache, table, None, 0.1, max_len=128, selected=chosen)
    k = torch.randn(8, 64, 8, 128).to(bf16)
    mha_decode(torch.randn(2, 64, 128).to(bf16), k, k.clone(), table, lens, 0.1, max_len=256)
    gather_pages(table, torch.tensor([0, 3, 7], dtype=i32), 7)
    rows = torch.tensor([1, 0], dtype=torch.int64)
    gather_pages(
        table, torch.tensor([0, 3, 7], dtype=i32), 7, out=torch.empty(8, dtype=i32), rows=rows
    )
    x = torch.randn(4, 1024).to(bf16)
    qx, sx = quantize_activations(x, 128)
    w = torch.randn(256, 1024).to(torch.float8_e4m3fn)
    ws = torch.ones(256, 8)
    for split in (1, 4):
        config = dict(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=3)
        out = torch.empty(4, 256, dtype=bf16)
        triton_matmul(qx, sx, 4, w, ws, 128, out, config | {"SPLIT_K": split})
    for tokens in (1, 40):  # blocks of 16 and of 64 tokens
        w_uv = torch.randn(16, 256, 512).to(bf16)[:, 128:]
        value_up_quantized(torch.randn(tokens, 16, 512).to(bf16), w_uv, 128)
    ids = torch.randint(0, 8, (4, 2), generator=gen)
    weights = torch.rand(4, 2)
    w13, w2 = torch.randn(8, 256, 1024).to(bf16), torch.randn(8, 1024, 128).to(bf16)
    fused_experts(x, w13, w2, weights, ids)
    scales = (torch.ones(8, 256, 8), torch.ones(8, 1024, 1))
    w13, w2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    fused_experts(x, w13, w2, weights, ids, scales=scales, fp8_block=128)


def gluon_launches(gen: torch.Generator) -> None:
    """The Gluon MLA decode: over contexts (two splits; one, which writes the output itself;
    no block read, the bench's floor) and over selected positions, with the engine's int64
    page tables and lengths."""
    from dserve.attention import gluon_mla

    if not gluon_mla.HAVE_GLUON:
        return
    bf16, i64 = torch.bfloat16, torch.int64
    cache = torch.randn(8, 64, 576, generator=gen).to(bf16)
    table, lens = torch.arange(8, dtype=i64).view(2, -1), torch.tensor([200, 256], dtype=i64)
    q, qr = torch.randn(2, 128, 512).to(bf16), torch.randn(2, 128, 64).to(bf16)
    for splits in (2, 1):
        gluon_mla.mla_decode(q, qr, cache, table, lens, 0.1, num_splits=splits)
    # 16 heads (attention TP 8): one program's 64 rows, padded
    gluon_mla.mla_decode(q[:, :16], qr[:, :16], cache, table, lens, 0.1, num_splits=2)
    # bench.mla_decode's floor: no block read
    gluon_mla.mla_decode(q, qr, cache, table, lens, 0.1, num_splits=2, read_blocks=False)
    chosen = torch.randint(0, 256, (2, 128), generator=gen)
    sparse = dict(num_splits=2, selected=chosen)
    gluon_mla.mla_decode(q[:, :64], qr[:, :64], cache, table, None, 0.1, **sparse)
    indexer_launch(gen, table, lens)


def indexer_launch(gen: torch.Generator, table: torch.Tensor, lens: torch.Tensor) -> None:
    """The Gluon indexer scores over FP8 keys (the pool's layout)."""
    from dserve.attention import gluon_indexer
    from dserve.attention.index_cache import key_scales
    from dserve.memory.kv_pool import KVLayout, KVPool

    fp8 = KVPool(KVLayout("index", 1, 64, torch.uint8, latent_dim=128), 8, "cpu").buffers[0]
    q = torch.randn(2, 32, 128, generator=gen).to(torch.bfloat16)
    rows = torch.arange(2, dtype=torch.int64)
    args = (q, torch.randn(2, 32), fp8[0], table, rows, lens, 0.1, 256)
    for q_fp8 in (False, True):
        scales = key_scales(fp8[1])
        gluon_indexer.indexer_scores(*args, key_scales=scales, per_program=128, q_fp8=q_fp8)


def _tree(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("start without TRITON_INTERPRET=1: the kernels must be JITFunctions")
    # a cache of its own: each Gluon variant goes through ptxas, whose notes are checked
    with tempfile.TemporaryDirectory(prefix="gpu-compile-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        return compile_all()


def compile_all() -> int:
    compiler = Compiler()
    JITFunction.run = lambda fn, *a, **k: compiler.run(fn, *a, **k)
    extend_launches(torch.Generator().manual_seed(0))
    dsa_and_norm_launches(torch.Generator().manual_seed(1))
    decode_and_gemm_launches(torch.Generator().manual_seed(2))
    gluon_launches(torch.Generator().manual_seed(3))
    for kernel in sorted(compiler.gluon_kernels - compiler.ptxas_seen):
        compiler.failures.append(f"{kernel}: no ptxas log read: its C7511 check saw nothing")
    for failure in compiler.failures:
        print("FAILED", failure)
    done, failed = compiler.compiled, len(compiler.failures)
    print(f"{done} kernel variants through the sm_90 front end (Gluon's compiled), {failed} failed")
    return 1 if compiler.failures else 0


if __name__ == "__main__":
    sys.exit(main())
