source bench/device/setup.sh
L=$OUT/log.txt
timeout 400 python3 -m bench.probe_moe --fp8 --tokens 64 16 128 --stages 2 3 4 5 --iters 30 --json $OUT/probe_fp8_wide.jsonl > $OUT/probe_fp8_wide.txt 2>&1
grep -E '"sweep": "(bf16 built-in|built-in|best)"|best_us' $OUT/probe_fp8_wide.txt >> $L
python3 - >> $L <<'PY'
import json
rows=[json.loads(l) for l in open("/dev/stdin")] if False else []
PY
python3 -c "
import json,sys
rows=[json.loads(l) for l in open('$OUT/probe_fp8_wide.jsonl')]
for sweep in ('gate_up','down'):
    r=sorted([x for x in rows if x.get('sweep')==sweep and x.get('tokens')==64], key=lambda x:x['us'])[:5]
    for x in r: print(sweep, x['gate_up'] if sweep=='gate_up' else x['down'], x['us'])
" >> $L
