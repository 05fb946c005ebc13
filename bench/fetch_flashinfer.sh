#!/bin/bash
# FlashInfer for a GPU host without a registry, in one carry of ~30 MB: download FlashInfer (JIT
# wheel, for torch 2.11 / CUDA 13), apache-tvm-ffi (its FFI, cp312) and requests (imported at
# `import flashinfer`), install them into a folder, drop the kernel sources of features the
# flashinfer backend never builds (MoE, Blackwell, sampling, ...: its MLA and prefill modules
# compile from csrc's top level, csrc/generated, csrc/nv_internal, include, cutlass and cccl),
# and pack the folder as .fi/fisite.tgz (.fi/ is in .gitignore), with .whl/'s pyzmq, msgpack, orjson, uvloop
# wheels beside it when there (the engine's own imports on the GPU image).
#
# On the GPU machine, one `run` carrying [".fi"]:
#   tar xzf .fi/fisite.tgz -C /tmp
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .fi/*.whl
#   export PYTHONPATH=/tmp/fi-site:/tmp/site MAX_JOBS=16   # kernels compile on first use with nvcc
# Run this way on an H100 on 2026-11-26 (bench/notes/session26-h100-2026-11-26.md); the first MLA
# module compiled in about a minute. (Before, four carried parts of the full dependency set:
# bench/notes/flashinfer-2026-11-23.md.)
set -euo pipefail
dest=${1:-.fi}
raw=$(mktemp -d)
site=$raw/fi-site
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$raw/wheels" flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any \
    -d "$raw/wheels" requests urllib3 idna certifi charset-normalizer
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
    "${plat[@]}" --target "$site" "$raw"/wheels/*.whl
csrc=$site/flashinfer/data/csrc
for d in "$csrc"/*/; do
  case "$(basename "$d")" in generated|nv_internal) ;; *) rm -rf "$d" ;; esac
done
rm -f "$csrc"/alphamoe_* "$csrc"/cake_* "$csrc"/blackwell_* "$csrc"/kda* "$csrc"/gdn*
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -rf "$site/bin" "$dest" && mkdir -p "$dest"
tar czf "$dest/fisite.tgz" -C "$raw" fi-site
cp .whl/pyzmq-*.whl .whl/msgpack-*.whl .whl/orjson-*.whl .whl/uvloop-*.whl "$dest/" 2>/dev/null || true
rm -rf "$raw"
du -sh "$dest"/*
