# Sourced by the A/B scripts (select_ab.sh, threshold_ab.sh) after setup.sh: the old tree unpacked
# from .devpack/tree_old.tgz (`git archive <old> -- . ':!bench/results' ':!tests'`), and helpers.
# t SECONDS CMD...: run with a limit, its status and time noted in $OUT/steps.txt
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
mkdir -p /tmp/old && tar xzf .devpack/tree_old.tgz -C /tmp/old
# old CMD...: run in the old tree
old() { (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old "$@"); }
STEPS=${STEPS:-"tests probe prefill forward"}
on() { [[ " $STEPS " == *" $1 "* ]]; }
# name=switches;... : the new tree's variants of the prefill, each a set of WIDEEP_* switches
VARIANTS=${VARIANTS:-"new="}
# prefill_rounds SECONDS ARGS...: bench.prefill_long ARGS, old tree then each variant, per round in ROUNDS
prefill_rounds() {
  local limit=$1; shift
  for i in $ROUNDS; do
    old t "$limit" python3 -m bench.prefill_long "$@" > "$OUT/prefill_old$i.log" 2>&1
    IFS=';' read -ra vs <<< "$VARIANTS"
    for v in "${vs[@]}"; do
      local name=${v%%=*} sw=${v#*=}
      env $sw timeout "$limit" python3 -m bench.prefill_long "$@" > "$OUT/prefill_${name}$i.log" 2>&1
      echo "rc=$? $name: $sw" >> "$OUT/steps.txt"
    done
    for f in "$OUT"/prefill_*$i.log; do echo "== $(basename "$f")"; grep -a "^| [0-9]" "$f"; done
  done
}
