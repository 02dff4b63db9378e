#!/usr/bin/env bash
# One GPU: the decode-graph changes of the thirty-third and thirty-fourth sessions that no GPU has
# run yet (no machine was lent): the GPU tests of the shared logits buffer, the sparse graphs of a
# raised shared width captured at start, later widths captured without an eager run, graphs
# captured ahead while idle, the Triton MLA kernels' splits (`tests`); the device memory serving
# adds with a graph per width, each graph's logits its own against the shared buffer (`serve`,
# bench/graph_widths.py); two-turn conversations with and without capturing ahead between the
# turns (`turns`); an expert-parallel rank's start and first steps with and without the warm-up
# (`ep`, bench/ep_decode.py, each in a process of its own with an empty Triton cache, as on a
# fresh machine); the MLA merge's one pass against the two passes before it (`merge`: the step's
# cost at its own and the shared width, bench/graph_widths.py, and sparse steps at 8K,
# bench/forward.py; then the same on .devpack/old, which must hold the tree before the change:
# `git show f507114~1:wideep_kernels/mla_decode.py`). PARTS picks some (default all but merge,
# about 9 minutes: past one call's 10-minute limit on a slow start, so `PARTS="tests turns"` then
# `PARTS="serve ep"`, then `PARTS=merge`). `PARTS=structured`: structured output's tests and the nucleus kernel's, and
# bench/structured.py and bench/sampling.py at DeepSeek's vocabulary (about 6 minutes).
source bench/device/setup.sh
PARTS=${PARTS:-tests serve turns ep}  # and merge, structured
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has tests; then
  t 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_path.py tests/test_async_scheduling.py \
    tests/test_chunk_rows.py tests/test_ep_step.py tests/test_kernel_mla_decode.py tests/test_capture_ahead.py \
    -k "later_widths or short_context_graphs or on_cuda or gpu_ or after_idle or (cuda and (keys_rows or far_wider or dense_matches))" > "$OUT/tests.log" 2>&1
  tail -n 3 "$OUT/tests.log"; grep -a FAILED "$OUT/tests.log"
  # logprobs read back beside the tokens through pinned memory, with steps launched ahead; penalties;
  # the top-k / top-p cuts against sorting; prompt logprobs from the eager prompt steps
  t 180 python3 -m pytest -q -p no:cacheprovider tests/test_logprobs.py tests/test_penalties.py tests/test_sampling.py \
    tests/test_prompt_logprobs.py > "$OUT/logprobs.log" 2>&1
  tail -n 3 "$OUT/logprobs.log"; grep -a FAILED "$OUT/logprobs.log"
fi
if has structured; then
  # the thirty-seventh session's structured output and deferred sampling, and the sampler's final
  # top-p path (.devpack/pydantic-site.tgz from bench/device/pack_pydantic.sh carries xgrammar)
  t 240 python3 -m pytest -q -p no:cacheprovider tests/test_structured_output.py tests/test_penalties.py \
    tests/test_async_scheduling.py tests/test_sampling.py tests/test_prompt_logprobs.py tests/test_kernel_nucleus.py \
    tests/test_call_grammars.py > "$OUT/structured_tests.log" 2>&1
  tail -n 3 "$OUT/structured_tests.log"; grep -a FAILED "$OUT/structured_tests.log"
  t 200 python3 -m bench.structured --device cuda --vocab 129280 --batches 1 16 64 --engine-preset bench \
    --json "$OUT/structured.jsonl" > "$OUT/structured.log" 2>&1
  t 120 python3 -m bench.sampling --device cuda --batches 1 16 64 --vocab 129280 > "$OUT/sampling.log" 2>&1
  cat "$OUT/structured.log" "$OUT/sampling.log"
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
if has merge; then
  for tree in new old; do
    [ "$tree" = old ] && cp -r .devpack/old/. .
    t 150 python3 -m bench.graph_widths --preset bench --batches 1 16 64 --parts cost --contexts 200 1200 2100 \
      > "$OUT/merge_$tree.log" 2>&1
    for b in 1 64; do
      t 90 python3 -m bench.forward --batch $b --contexts 8192 --iters 10 > "$OUT/merge_${tree}_forward$b.log" 2>&1
    done
  done
  grep -ah '"part"' "$OUT"/merge_new.log "$OUT"/merge_old.log
  tail -n 4 "$OUT"/merge_*_forward*.log
fi
cat "$OUT/steps.txt"
grep -ahs '"part"\|"mode"' "$OUT"/serve.log "$OUT"/turns.log "$OUT"/ep_decode*.log | grep -v '"rows"'
