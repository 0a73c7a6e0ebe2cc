#!/usr/bin/env bash
# The 2-GPU measurements of issue 54's step-time levers, in parts that each stay under the device's 10-minute limit
# per command: the GPU tests of the levers not yet run on GPUs, then the 8B pairs (torchtitan and loom one after the
# other in the call) with each lever as a loom variant beside the plan-first layout it changes.
#
# Usage (on nvidia-h200-x2, from the repository root, carrying bench/wheels):
#   LOOM_COMMIT=<sha> bash bench/run_2gpu_levers.sh PART OUT_DIR
# PART: tests | float8 | bf16 | profile
# Copy OUT_DIR/*.json into bench/results/ afterwards (docs/benchmarks.md says which file each row reads).
set -u
part=${1:?PART}; out=${2:?OUT_DIR}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site bench/wheels/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
commit=${LOOM_COMMIT:?LOOM_COMMIT}

# the plan-first layout (ZeRO-2 without activation checkpointing) with symmetric memory, and each lever on top
z2='training.activation_checkpointing=none;parallel.zero=2;parallel.fsdp_symm_mem=true'
levers=(--loom-variant "z2sm:$z2"
        --loom-variant "z2smsag:$z2;optimizer.step_at_gather=true"
        --loom-variant "z2smsagnk:$z2;optimizer.step_at_gather=true;training.grad_norm_kernel=triton")

case $part in
  tests)  # the levers' GPU tests (eager, deterministic): same losses as without them (~4 min)
    timeout 560 python3 -m pytest -q -x tests/gpu/test_multi_gpu.py -p no:cacheprovider \
      -k "step_at_gather or grad_norm_kernel or symm_mem or grad_copy" ;;
  float8)  # torchtitan float8 (op-level AC, its documented setting) against the float8-gather variants (~6 min)
    timeout 570 python3 -m bench.peers --workload llama3_8b --ac op --sides torchtitan --float8 tensorwise \
      --float8-all-gather "${levers[@]}" --steps 11 --warmup 4 --timeout 120 --commit "$commit" \
      --run-dir /tmp/levers_f8 --out "$out/peers_llama3_8b_float8ag_levers_2gpu_h200.json" ;;
  bf16)  # the same in bf16 (~6 min)
    timeout 570 python3 -m bench.peers --workload llama3_8b --ac op --sides torchtitan "${levers[@]}" \
      --steps 11 --warmup 4 --timeout 120 --commit "$commit" \
      --run-dir /tmp/levers_bf16 --out "$out/peers_llama3_8b_levers_2gpu_h200.json" ;;
  profile)  # both ranks' traces of the float8 plan-first layout with every lever (~3 min), archived
    mkdir -p /tmp/levers_traces
    timeout 400 python3 -m bench.peers --workload llama3_8b --sides loom --float8 tensorwise --float8-all-gather \
      --ac none --loom-set parallel.zero=2 --loom-set parallel.fsdp_symm_mem=true \
      --loom-set optimizer.step_at_gather=true --loom-set training.grad_norm_kernel=triton --profile \
      --profile-dir /tmp/levers_traces --steps 10 --warmup 4 --timeout 150 --commit "$commit" \
      --run-dir /tmp/levers_prof --out "$out/peers_llama3_8b_float8ag_levers_profile_2gpu_h200.json"
    tar czf "$out/levers_traces.tgz" -C /tmp/levers_traces . ;;
  *) echo "unknown part $part: tests | float8 | bf16 | profile" >&2; exit 2 ;;
esac
