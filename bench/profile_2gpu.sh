#!/usr/bin/env bash
# Profiles of 1B layouts on two GPUs (bench/profile_layout.py), same settings as bench/parallel_2gpu.py.
# Usage: bash bench/profile_2gpu.sh OUT_DIR
set -u
out=${1:-/tmp/loom_profiles}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
common="--model.flavor=1B --training.seq_len=2048 --training.dtype=bfloat16 --optimizer.implementation=fused
 --metrics.tensorboard=false --checkpoint.at_end=false --data.cache_dir=/tmp/loom_prof_cache --run.device=cuda
 --training.micro_batch_size=4"
run() {  # name nproc overrides...
  local name=$1 n=$2; shift 2
  torchrun --standalone --nproc-per-node "$n" bench/profile_layout.py --out "$out/profile_1b_$name.json" -- \
    $common --run.dir=/tmp/loom_prof_$name "$@" 2>&1 | grep '^{' | sed "s/^/$name /"
}
run single 1 --training.global_batch_size=8
run fsdp2 2 --training.global_batch_size=16 --parallel.dp_shard=2
run fsdp2_noreshard 2 --training.global_batch_size=16 --parallel.dp_shard=2 --parallel.reshard_after_forward=false
run tp2 2 --training.global_batch_size=16 --parallel.tp=2 --parallel.dp_shard=1
