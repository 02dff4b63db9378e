#!/usr/bin/env bash
# One GPU: the decode-graph changes of the thirty-third and thirty-fourth sessions that no GPU has
# run yet (no machine was lent): the GPU tests of the shared logits buffer, the sparse graphs of a
# raised shared width captured at start, later widths captured without an eager run, graphs
# captured ahead while idle, the Triton MLA kernels' splits (`tests`); the device memory serving
# adds with a graph per width, each graph's logits its own against the shared buffer (`serve`,
# bench/graph_widths.py); two-turn conversations with and without capturing ahead between the
# turns (`turns`); an expert-parallel rank's start and first steps with and without the warm-up
# (`ep`, bench/ep_decode.py, each in a process of its own with an empty Triton cache, as on a
# fresh machine). PARTS picks some (default all, about 9 minutes: past one call's 10-minute limit
# on a slow start, so `PARTS="tests turns"` then `PARTS="serve ep"`).
source bench/device/setup.sh
PARTS=${PARTS:-tests serve turns ep}
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has tests; then
  t 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_path.py tests/test_async_scheduling.py \
    tests/test_chunk_rows.py tests/test_ep_step.py tests/test_kernel_mla_decode.py tests/test_capture_ahead.py \
    -k "later_widths or short_context_graphs or on_cuda or gpu_ or after_idle or (cuda and (keys_rows or far_wider or dense_matches))" > "$OUT/tests.log" 2>&1
  tail -n 3 "$OUT/tests.log"; grep -a FAILED "$OUT/tests.log"
fi
has serve && t 130 python3 -m bench.graph_widths --preset bench --batches 1 64 --parts serve \
  --modes per_width per_width_own_logits shared > "$OUT/serve.log" 2>&1
has turns && t 150 python3 -m bench.graph_widths --preset bench --batches 1 16 --parts turns > "$OUT/turns.log" 2>&1
if has ep; then
  for w in --warmup ""; do
    export TRITON_CACHE_DIR=$(mktemp -d)
    t 200 python3 -m bench.ep_decode --modes ep --batches 1 16 64 $w \
      > "$OUT/ep_decode${w:+_warmup}.log" 2>&1
  done
fi
cat "$OUT/steps.txt"
grep -ahs '"part"\|"mode"' "$OUT"/serve.log "$OUT"/turns.log "$OUT"/ep_decode*.log | grep -v '"rows"'
