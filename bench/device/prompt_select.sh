#!/usr/bin/env bash
# The indexer's top-k selection over a prompt chunk's rows (bench.probe_select --prompt: the row
# split, the atomics' options, the threshold select and torch.topk), and the decode rows' default
# split at 128-256 rows with and without the atomics. Carry .devpack/pydantic-site.tgz.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
t 360 python3 -m bench.probe_select --prompt --batches 1024 2048 --widths 16384 32768 65536 131072 --iters 10 \
  --json "$OUT/probe_prompt.jsonl" > "$OUT/probe_prompt.log" 2>&1
grep -a "^|" "$OUT/probe_prompt.log" || tail -n 5 "$OUT/probe_prompt.log"
t 120 python3 -m bench.probe_select --batches 64 128 256 --widths 10240 --iters 10 \
  --json "$OUT/probe_decode.jsonl" > "$OUT/probe_decode.log" 2>&1
grep -a "^|" "$OUT/probe_decode.log" || tail -n 5 "$OUT/probe_decode.log"
cat "$OUT/steps.txt"
cd "$OUT" && tar czf /tmp/all.tgz . && rm -rf "$OUT"/* && mv /tmp/all.tgz "$OUT/"
