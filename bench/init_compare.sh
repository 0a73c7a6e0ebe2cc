#!/usr/bin/env bash
# model.residual_init depth vs flat: 1B (bench/train_1b.py, same batches) and 125M through the CLI (default data
# and optimizer). Writes JSON / metrics.jsonl under $OUT (default bench/results). Usage: bash bench/init_compare.sh
OUT=${OUT:-bench/results}
export LOOM_COMMIT=${LOOM_COMMIT:-$(git rev-parse --short HEAD)}
PYTHONPATH=$PWD timeout 330 python bench/train_1b.py --variants loom_compile_depth_init,loom_compile_flat_init --steps 120 --warmup 5 --out $OUT/train_1b_init_curve_h100.json 2>&1 | grep -v -i warn | tail -4
for init in depth flat; do
  PYTHONPATH=$PWD timeout 110 python -c "from loom.cli.main import entry; entry()" train --model.flavor 125M --training.steps 300 --training.compile true --model.residual_init $init --metrics.every 1 --checkpoint.at_end false --run.dir /tmp/r125_$init > /tmp/r125_$init.log 2>&1; echo "$init rc $?"; tail -2 /tmp/r125_$init.log
  cp /tmp/r125_$init/metrics.jsonl $OUT/r125m_$init.jsonl 2>/dev/null
  cp /tmp/r125_$init/config.toml $OUT/r125m_$init.toml 2>/dev/null
done
