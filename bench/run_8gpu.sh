#!/usr/bin/env bash
# The 8-GPU runs (issue 5) in parts that each stay under the device's 10-minute limit per command.
# Every part resumes from what an earlier part (or an earlier session) left in bench/results/, writes the
# updated JSON + markdown into OUT_DIR, and can be repeated: finished layouts are skipped.
#
# Usage (on the 8-GPU machine, from the repository root):
#   LOOM_COMMIT=<sha> bash bench/run_8gpu.sh PART OUT_DIR
# PART: layouts-debug | layouts-125m | layouts-125m-bf16 | layouts-moe | layouts-docs | throughput-fsdp8 |
#       throughput-layouts | throughput-planned
# Copy OUT_DIR/* into bench/results/ afterwards, and run the same PART again if it was cut short.
set -u
part=${1:?PART}; out=${2:?OUT_DIR}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

resume() {  # results file name: start from the copy in bench/results/ if there is one
  [ -f "bench/results/$1" ] && [ ! -f "$out/$1" ] && cp "bench/results/$1" "$out/$1"
  echo "$out/$1"
}

case $part in
  layouts-debug)  # fp32 layout invariance, debug flavor, every 8-GPU layout (~20-30 s each)
    timeout 570 python -m bench.layouts --gpus 8 --flavors debug --resume --timeout 150 \
      --out "$(resume layouts_8gpu_h200.json)" ;;
  layouts-125m)
    timeout 570 python -m bench.layouts --gpus 8 --flavors 125M --resume --timeout 150 \
      --out "$(resume layouts_8gpu_h200.json)" ;;
  layouts-125m-bf16)  # the bf16 spread of the same layouts
    timeout 570 python -m bench.layouts --gpus 8 --flavors 125M --dtype bfloat16 --resume --timeout 150 \
      --out "$(resume layouts_8gpu_h200_bf16.json)" ;;
  layouts-moe)  # the MoE flavor (8 experts) under every layout (EP not with TP), fp32
    timeout 570 python -m bench.layouts --gpus 8 --flavors debug_moe --resume --timeout 150 \
      --out "$(resume layouts_8gpu_h200.json)" ;;
  layouts-docs)  # packed documents with the document mask (CP chunk pairs, positions through pipeline stages)
    timeout 570 python -m bench.layouts --gpus 8 --flavors debug_docs --resume --timeout 150 \
      --out "$(resume layouts_8gpu_h200.json)" ;;
  throughput-fsdp8)  # the headline: 8B, seq 8192, FSDP8, bf16, compile, AC op, local batch 2
    timeout 570 python -m bench.throughput --gpus 8 --flavor 8B --seq 8192 --layouts fsdp8 --global-batch 16 \
      --compile --ac op --resume --timeout 540 --out "$(resume throughput_8b_8gpu_h200.json)" ;;
  throughput-layouts)  # candidates for the fastest layout at the same global batch
    timeout 570 python -m bench.throughput --gpus 8 --flavor 8B --seq 8192 \
      --layouts fsdp8,hsdp2x4,fsdp4_tp2,fsdp4_pp2_1f1b,fsdp4_cp2 --global-batch 16 --compile --ac op --resume --timeout 200 \
      --out "$(resume throughput_8b_8gpu_h200.json)" ;;
  throughput-planned)  # the layout `loom plan --search` proposes for the same job, searched here, then measured
    python -m loom plan --model.flavor 8B --training.seq_len 8192 --training.dtype bfloat16 \
      --training.compile true --training.global_batch_size 16 --training.micro_batch_size 1 --model.attention sdpa \
      --gpus 8 --gpu H200 \
      --search --top 5 --json "$out/plan_8b_8gpu_h200.json" || exit 1
    timeout 540 python -m bench.throughput --gpus 8 --flavor 8B --seq 8192 \
      --plan "$out/plan_8b_8gpu_h200.json" --global-batch 16 --compile --resume --timeout 500 \
      --out "$(resume throughput_8b_8gpu_planned_h200.json)" ;;
  *) echo "unknown PART $part" >&2; exit 2 ;;
esac
