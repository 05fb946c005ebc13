"""Which Triton kernel variants an engine compiles after its warm-up, on a GPU.

A variant compiled during a request stalls it for 0.2-0.5 s (session 25: `_place_kernel` at
448-522 tokens on an H100). This runs an engine on a tiny checkpoint in this process, warms it
up as a serving instance does (`http_server.warm_up`), then sends prompts of many lengths and
a few batches, and prints every variant compiled after the warm-up with its key: the argument
types and their specialization (`'D'`: a multiple of 16, `('constexpr', 1)`: the value 1) and
the constexpr values, so the argument that made a new variant shows in the diff.

    python -m tests.tools.kernel_variants deepseek_v3 [glm_moe_dsa deepseek_v3:block ...]

`ARCH:block` / `ARCH:channel` writes an FP8 checkpoint. The GPU test of the same property is
`tests/runtime/test_startup.py::test_no_kernel_compiles_after_ready_and_the_first_request_is_fast`.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile

LENGTHS = [*range(1, 70), 100, 127, 128, 129, 255, 256, 257, 448, 485, 512, 513, 777, 1000]
BATCHES = (3, 5, 8, 13)


def variants() -> set[tuple[str, str]]:
    """(kernel name, key) of every variant compiled in this process."""
    from triton.runtime.jit import JITFunction

    found = set()
    for obj in gc.get_objects():
        if isinstance(obj, JITFunction):
            for entry in obj.device_caches.values():
                found |= {(obj.fn.__name__, str(key)) for key in entry[0]}
    return found


def late_variants(spec: str, workdir: str) -> dict[str, list]:
    """Per kernel, the (what was sent, key) of each variant compiled after the warm-up."""
    from dserve.models.tiny import make_tiny
    from dserve.runtime import Engine

    arch, _, fp8 = spec.partition(":")
    model = make_tiny(arch, os.path.join(workdir, arch), fp8=fp8 or None)
    engine = Engine(model, max_total_tokens=16384)
    try:
        return _sends_after_warm_up(engine)
    finally:
        engine.shutdown()


def _sends_after_warm_up(engine) -> dict[str, list]:
    from dserve.runtime import SamplingParams
    from dserve.runtime.http_server import warm_up

    warm_up(engine)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    sends = [(f"{n} tokens", [[3 + j % 50 for j in range(n)]]) for n in LENGTHS]
    for b in BATCHES:
        batch = [[3 + (j + k) % 50 for j in range(17 * k + 5)] for k in range(b)]
        sends.append((f"{b} prompts", batch))
    seen, late = variants(), {}
    for what, prompts in sends:
        engine.generate(input_ids=prompts, sampling_params=params)
        now = variants()
        for name, key in sorted(now - seen):
            late.setdefault(name, []).append((what, key))
        seen = now
    return late


def main(specs: list[str]) -> int:
    workdir = tempfile.mkdtemp()
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(workdir, "triton"))  # cold
    any_late = False
    for spec in specs:
        late = late_variants(spec, workdir)
        print(f"{spec}: {sum(map(len, late.values()))} variants compiled after the warm-up")
        for name, items in late.items():
            any_late = True
            print(f"  {name}: at {[what for what, _ in items]}")
            for what, key in items[:4]:
                print(f"    {what}: {key}")
    return 1 if any_late else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["deepseek_v3"]))
