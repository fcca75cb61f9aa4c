#!/usr/bin/env bash
# Resume at another worker count, every strategy at its defaults on lenet and digits, seed 0, one torch
# thread a worker: 300 steps on 2 workers, then `--resume --workers 3` to step 600 (resize keep-global-batch,
# the default), and for comparison the uninterrupted 600-step run on 2 workers. Strategies that refuse the
# resize (their state is cut for the old count) are recorded with their message.
# Writes OUT/<strategy>/ (the resized run), OUT/<strategy>-full/ (the uninterrupted one), their logs and
# OUT/<strategy>.time (the start and end of the two parts and of the full run); for the synchronous rules that
# exchange every step (allreduce, weight-avg) also OUT/<strategy>-step301/, the 300-step run resumed at 3
# workers for one step, and OUT/<strategy>-full301/, 301 uninterrupted steps: their difference is the resize's
# own, before 300 steps amplify it;
# scripts/resize_results.py renders docs/results/resize.json.
set -uo pipefail
out=${1:-runs/resize-check}
shift || true
strategies=("$@")
[ ${#strategies[@]} -eq 0 ] && strategies=(allreduce ps-sync weight-avg box-sync downpour easgd eamsgd dynsgd
  hogwild dogwild diloco single hybrid pipeline pipeline-dp sandblaster)
mkdir -p "$out"
now() { date +%s.%N; }
train() { python -m parambox train --seed 0 --threads 1 --no-progress "$@"; }
for s in "${strategies[@]}"; do
  rm -rf "$out/$s" "$out/$s-full" "$out/$s-step301" "$out/$s-full301" "$out/$s".*.log "$out/$s.time"
  t0=$(now)
  train --strategy "$s" --workers 2 --steps 300 --out "$out/$s" > "$out/$s.part1.log" 2>&1 \
    || { echo "$s: the first 300 steps failed (exit $?): $out/$s.part1.log"; continue; }
  t1=$(now)
  case $s in allreduce|weight-avg)
    cp -r "$out/$s" "$out/$s-step301"
    sed -i "s#/$s\"#/$s-step301\"#" "$out/$s-step301/config.json"  # its "out"
    train --out "$out/$s-step301" --resume --workers 3 --steps 301 > "$out/$s.step301.log" 2>&1
    train --strategy "$s" --workers 2 --steps 301 --out "$out/$s-full301" > "$out/$s.full301.log" 2>&1;;
  esac
  t2=$(now)
  train --out "$out/$s" --resume --workers 3 --steps 600 > "$out/$s.part2.log" 2>&1
  rc=$?
  t3=$(now)
  if [ $rc -ne 0 ]; then
    echo "$s: the resume at 3 workers exited $rc: $(tail -n 1 "$out/$s.part2.log")"
    continue
  fi
  train --strategy "$s" --workers 2 --steps 600 --out "$out/$s-full" > "$out/$s.full.log" 2>&1 \
    || echo "$s: the uninterrupted run failed (exit $?): $out/$s.full.log"
  t4=$(now)
  echo "$t0 $t1 $t2 $t3 $t3 $t4" > "$out/$s.time"
  echo "$s: done"
done
