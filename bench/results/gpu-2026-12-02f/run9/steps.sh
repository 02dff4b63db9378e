source bench/device/setup.sh
L=$OUT/log.txt
timeout 75 python3 -m bench.tune_kernels --shapes 'bf16|topk' > $OUT/tune.txt 2>&1
python3 -c "
import json; d=json.load(open('kernels/tuned/NVIDIA_H200.json'))
print(json.dumps({k: v for k, v in d['mla_decode'].items() if k.startswith('bf16|topk')}, sort_keys=True))" > $OUT/entries.json
timeout 35 python3 -m bench.forward --batch 16 --contexts 8192 --iters 10 --json $OUT/fwd16.jsonl > $OUT/fwd16.txt 2>&1
echo done >> $L
