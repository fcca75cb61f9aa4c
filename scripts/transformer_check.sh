#!/usr/bin/env bash
# Every strategy at its defaults on the zoo's gpt (1M parameters) and the text corpus, in fp32 and bf16:
# does it train, and does bf16 end where fp32 does? 150 steps of 8 windows of 128 bytes a worker, seed 0,
# two workers (hybrid and pipeline-dp four; single one; the pipelines cut at block 3, the tied embedding
# and output layer in two stages).
# Writes OUT/<strategy>-<precision>/ run directories (fp32again: a second fp32 run); scripts/transformer_results.py renders the JSON.
set -uo pipefail
out=${1:-runs/transformer-check}
mkdir -p "$out"
for s in single allreduce ps-sync weight-avg box-sync downpour easgd eamsgd dynsgd hogwild dogwild hybrid diloco pipeline pipeline-dp sandblaster; do
  model=gpt; w=2; extra=()
  [ "$s" = single ] && w=1
  [ "$s" = hybrid ] || [ "$s" = pipeline-dp ] && w=4
  case $s in pipeline|pipeline-dp) extra=(--set "$s.split_points=[3]");; esac
  precisions=(fp32 bf16)
  # Where the interleaving of workers is the machine's, a second fp32 run measures the run-to-run spread
  # that bf16's difference is to be read against.
  case $s in downpour|dynsgd|hogwild|dogwild|easgd|eamsgd|hybrid) precisions+=(fp32again);; esac
  for p in "${precisions[@]}"; do
    rm -rf "$out/$s-$p"
    python -m parambox train --strategy "$s" --workers "$w" --model "$model" --data text --steps 150 \
      --batch-size 8 --precision "${p%again}" --seed 0 --out "$out/$s-$p" --no-progress "${extra[@]}" \
      > "$out/$s-$p.log" 2>&1 || echo "$s $p failed (exit $?): $out/$s-$p.log"
  done
done
