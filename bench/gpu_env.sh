# Source on a GPU host without an install: exposes the repository as the `dserve` namespace package
# and sets the NCCL settings every multi-GPU process here must have.
ns=/tmp/dserve-ns/dserve
mkdir -p "$ns"
for d in runtime models attention kernels memory step scheduler spec transfer; do ln -sfn "$PWD/$d" "$ns/$d"; done
export PYTHONPATH=/tmp/dserve-ns:$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
