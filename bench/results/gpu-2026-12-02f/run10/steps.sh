source bench/device/setup.sh
timeout 38 python3 -m bench.forward --batch 4 --contexts 8192 --iters 10 --mla-override '{"slots":false}' --json $OUT/fwd.jsonl > $OUT/fwd4.txt 2>&1
timeout 38 python3 -m bench.forward --batch 1 --contexts 8192 --iters 10 --mla-override '{"num_warps":8}' --json $OUT/fwd.jsonl > $OUT/fwd1.txt 2>&1
