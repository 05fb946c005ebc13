#!/bin/bash
# Download FlashInfer (JIT wheel, for torch 2.11 / CUDA 13) and the packages it imports that the GPU
# image lacks, and cut them into pieces that fit the device tool's 64 MiB carry limit, one folder per
# call: .fi/part1, .fi/part2, ... (.fi/ is in .gitignore).
#
# On one warm GPU machine, one `run` per part, each carrying its folder (carry [".fi/partN"]):
#   mkdir -p /tmp/fi && cp .fi/partN/* /tmp/fi/
# then, in the last call (or a following one):
#   cd /tmp/fi && for w in $(ls *.part-aa | sed 's/.part-aa$//'); do cat $w.part-* > $w; rm $w.part-*; done
#   python3 -m pip install -q --no-index --no-deps --target /tmp/fisite /tmp/fi/*.whl
#   export PYTHONPATH=/tmp/fisite:$PYTHONPATH   # kernels compile on first use with the image's nvcc
# Run this way on an H100 on 2026-11-23: bench/notes/flashinfer-2026-11-23.md.
set -euo pipefail
dest=${1:-.fi}
raw=$(mktemp -d)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0 \
           nccl4py==0.6.0 nccl-extensions cuda-tile==1.7.0 nvidia-cutlass-dsl==4.8.1 \
           nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
           nvidia-cutlass-dsl-libs-cu13==4.8.1; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${plat[@]}" -d "$raw" "$pkg"
done
(cd "$raw" && for w in *.whl; do split -b 27M -a 2 "$w" "$w.part-"; rm "$w"; done)
# fill parts of at most 56 MiB (the working tree travels too), largest pieces first
rm -rf "$dest" && mkdir -p "$dest"
part=1 used=0
for f in $(ls -S "$raw"); do
  size=$(stat -c %s "$raw/$f")
  if (( used + size > 56 * 1024 * 1024 )); then part=$((part + 1)); used=0; fi
  mkdir -p "$dest/part$part" && mv "$raw/$f" "$dest/part$part/" && used=$((used + size))
done
rmdir "$raw"
du -sh "$dest"/part*
