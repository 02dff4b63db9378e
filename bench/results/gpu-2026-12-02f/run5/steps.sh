source bench/device/setup.sh
L=$OUT/log.txt
echo "== gluon tests" >> $L
timeout 200 python3 -m pytest -q -x --tb=short -p no:cacheprovider tests/test_kernel_mla_decode.py -k "gluon and cuda" >> $L 2>&1
echo "== probe configs" >> $L
C='[{"block_n":64,"num_warps":4,"num_stages":2,"waves":1,"slots":false,"keys_rows":true,"gluon":true},
{"block_n":64,"num_warps":4,"num_stages":2,"waves":1,"slots":true,"keys_rows":true,"gluon":true},
{"block_n":64,"num_warps":4,"num_stages":3,"waves":1,"slots":false,"keys_rows":true,"gluon":true},
{"block_n":64,"num_warps":4,"num_stages":3,"waves":1,"slots":true,"keys_rows":true,"gluon":true},
{"block_n":64,"num_warps":8,"num_stages":3,"waves":1,"slots":false,"keys_rows":true,"gluon":true},
{"block_n":64,"num_warps":4,"num_stages":3,"waves":1,"min_tiles":4,"slots":false,"keys_rows":true,"gluon":true}]'
timeout 120 python3 -m bench.probe_mla --batches 64 16 1 --sections configs --configs "$C" > $OUT/mla.txt 2>&1
grep -v '"build"' $OUT/mla.txt | tail -25 >> $L
echo "== forward b64 slots A/B" >> $L
timeout 130 python3 -m bench.forward --batch 64 --contexts 8192 --iters 10 --mla-override '{"slots":true}' --json $OUT/fwd64s.jsonl > $OUT/fwd64s.txt 2>&1
cat $OUT/fwd64s.jsonl >> $L
echo "== forward b64 stages A/B" >> $L
timeout 130 python3 -m bench.forward --batch 64 --contexts 8192 --iters 10 --mla-override '{"num_stages":3}' '{"num_stages":3,"slots":true}' --json $OUT/fwd64.jsonl > $OUT/fwd64.txt 2>&1
cat $OUT/fwd64.jsonl >> $L
echo done >> $L
