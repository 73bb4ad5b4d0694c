"""The autotuner's timer on a kernel of a few microseconds: the sleep queued ahead of each timed
launch fixed at 0.1 ms, against the one ``ops.tuning.autotune.sleep_cycles`` sizes from the host's time.

    python -m tests.benchmark.tuner_timer          # on a CUDA GPU

For the first eight configs of ``chunk_cumsum``'s search space at 1 x 4K tokens x 80 heads (chunk
128, bf16): the host time of one call (median and slowest of 20), and five timings by
``cuda_event_timer`` with each sleep, in microseconds. If the sleep ends before the host has
queued the kernel, the events time the host too, and the five timings spread.
"""
import statistics
import time

import torch

from ops.tuning import autotune
from ops.kernels.chunk_cumsum import chunk_cumsum, search_space


def main():
    if not torch.cuda.is_available():
        raise SystemExit("tuner_timer needs a CUDA GPU")
    torch.manual_seed(0)
    b, L, h, q = 1, 4096, 80, 128
    dt = torch.randn(b, L, h, device="cuda", dtype=torch.bfloat16)
    A = -torch.rand(h, device="cuda", dtype=torch.float32)
    bias = torch.randn(h, device="cuda", dtype=torch.float32)
    space = search_space(batch=b, seqlen=L, nheads=h, chunk_size=q, dtype=torch.bfloat16)
    sized = autotune.sleep_cycles
    rules = (("fixed 0.1 ms", lambda host_s: 200_000), ("sized", sized))
    for cfg in [c for c in space if not c.get("INDEX64")][:8]:
        fn = lambda: chunk_cumsum(dt, A, q, dt_bias=bias, dt_softplus=True, config=cfg)
        fn()
        torch.cuda.synchronize()
        host = []
        for _ in range(20):
            start = time.perf_counter()
            fn()
            host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        timings = {}
        for name, rule in rules:
            autotune.sleep_cycles = rule            # what cuda_event_timer sizes its sleep with
            try:
                timings[name] = [autotune.cuda_event_timer(fn) * 1e3 for _ in range(5)]
            finally:
                autotune.sleep_cycles = sized
        shown = {k: v for k, v in cfg.items() if v is not None}
        print(f"{str(shown):70s} host median {statistics.median(host) * 1e6:6.1f} us max "
              f"{max(host) * 1e6:6.1f} | " + " | ".join(
                  f"{name}: " + " ".join(f"{t:6.1f}" for t in ts) + " us" for name, ts in timings.items()),
              flush=True)


if __name__ == "__main__":
    main()
