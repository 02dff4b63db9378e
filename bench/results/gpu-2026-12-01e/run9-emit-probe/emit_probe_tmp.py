import torch, time, sys
import kernels.indexer as ix
from kernels import pdl
torch.manual_seed(0)
W, G, K = 524352, 524161, 2048
s = torch.randn(1, W, device="cuda"); s[:, G:] = float("-inf")
g = torch.tensor([G], dtype=torch.int32, device="cuda")
def ev(fn, n=20):
    fn(); torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    ts.sort(); return ts[len(ts) // 2]
orig = pdl.MODE
for one in (True, False):
    ix.ONE_EMIT = one
    for mode in (0, orig):
        pdl.MODE = mode
        e = ev(lambda: ix.select_topk_triton(s, g, K, method="radix"))
        gr = torch.cuda.CUDAGraph(); ix.select_topk_triton(s, g, K, method="radix"); torch.cuda.synchronize()
        with torch.cuda.graph(gr):
            for _ in range(16): ix.select_topk_triton(s, g, K, method="radix")
        gt = ev(gr.replay) / 16
        print(f"one_emit={one} pdl={mode} eager_us={e:.1f} graph_us={gt:.1f}", flush=True)
    pdl.MODE = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(5): ix.select_topk_triton(s, g, K, method="radix")
        torch.cuda.synchronize()
    for e in p.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or "kernel" in e.key:
            print(f"  one_emit={one} {e.key[:40]} {e.device_time:.1f}us x{e.count}")
