"""The model shapes the benchmarks time: one Mamba-2 layer's scan as each model calls it.

``tests/benchmark/models.py`` runs them; notebooks 07 and 08 read their rows by these names.
Every shape has headdim 64 and dstate 128 and is timed in ``DTYPE``."""

MODELS = {
    "mamba2-130m-train": dict(batch=16, seqlen=2048, nheads=24, headdim=64, ngroups=1, dstate=128),
    "mamba2-2.7b-train": dict(batch=8, seqlen=2048, nheads=80, headdim=64, ngroups=1, dstate=128),
    "mamba2-2.7b-prefill": dict(batch=1, seqlen=4096, nheads=80, headdim=64, ngroups=1, dstate=128),
    "8b-hybrid-layer": dict(batch=2, seqlen=8192, nheads=128, headdim=64, ngroups=8, dstate=128),
}
DTYPE = "bf16"
