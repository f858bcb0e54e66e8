"""One Horovod rank for scripts/bench_horovod.py (runs in Horovod's own venv: torch 2.0.1).

Times ``hvd.allreduce`` (average, gloo) of a float32 payload; rank 0 prints one JSON line.
Deliberately imports nothing from syncplane: it runs under a different torch.
"""

import json
import sys
import time

import horovod.torch as hvd
import torch

payload_bytes, steps, warmup = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
hvd.init()
torch.set_num_threads(1)
x = torch.randn(payload_bytes // 4)
times = []
for step in range(warmup + steps):
    hvd.allreduce(torch.zeros(1), name="barrier")          # line the ranks up, like the syncplane bench
    start = time.perf_counter()
    x = hvd.allreduce(x, op=hvd.Average, name="payload")
    elapsed = hvd.allreduce(torch.tensor([time.perf_counter() - start]), op=hvd.Max, name="elapsed").item()
    if step >= warmup:
        times.append(elapsed)
if hvd.rank() == 0:
    print("HOROVOD_RESULT " + json.dumps({"size": hvd.size(), "step_s": times}), flush=True)
