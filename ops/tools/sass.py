"""What a kernel becomes on a given GPU: its machine code (SASS), read without the GPU.

A cuTile kernel is compiled by TileIR for one architecture at a time, and the compiler makes
very different programs for each: Ampere (sm_80) multiplies with warp-level ``HMMA``, Hopper
(sm_90) with warpgroup ``HGMMA`` (wgmma, operands in shared memory), Blackwell (sm_100) with
``UTCHMMA`` (tcgen05.mma, issued by one thread, accumulator in tensor memory, read back with
``LDTM``). Whether a tile size or a code change really turns into those instructions, and
what it costs in registers, spills and shared memory, can be answered on any machine:

    from ops.tools.plans import representative_plan
    from ops.tools.sass import sass_report, compare
    kernel, args = representative_plan("compute_out")
    print(sass_report(kernel, args, "sm_100"))
    compare([sass_report(kernel, args, a) for a in ("sm_90", "sm_100")])

or from a shell: ``python -m ops.tools.sass compute_out --arch sm_90,sm_100 --set block_m=128``.

``sass_report`` compiles the launch (specialized as a launch on the GPU would be: see
``ops.tools.aot.launch_signature``; ``specialize=False`` takes ``ops.tools.aot.signature_of`` for
arbitrary arrays, a very different program) and reads the cubin with
NVIDIA's ``nvdisasm`` (the instructions) and ``cuobjdump`` (resource usage and the ELF
attributes the compiler leaves for the driver: block size, register cap, spill annotations).
Both come as pip wheels (``nvidia-cuda-nvdisasm``, ``nvidia-cuda-cuobjdump``).

The counts are static: instructions in the program, not instructions executed. A loop body
counts once, an unrolled loop once per copy. They show *what kind* of code the compiler
chose; only a profiler on the GPU says how fast it runs.
"""
import argparse
import ast
import collections
import dataclasses
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch


from ops import mamba_chunk_scan_combined
from ops.core import core_forward
from ops.runtime import launch as launch_module
from ops.runtime.cutile_internals import kernel_function
from ..forward import KERNELS
from .aot import compile_cubin, launch_signature, signature_of
from .plans import SHAPE, plan_options, representative_plan

# The pip wheel each tool comes in (the error message names it).
TOOL_PACKAGES = {"nvdisasm": "nvidia-cuda-nvdisasm", "cuobjdump": "nvidia-cuda-cuobjdump"}


def find_tool(name):
    """Path of an NVIDIA binary tool: first inside the pip wheels (``nvidia/cu13/bin/``, or a
    ``bin`` folder of any other ``nvidia`` package), then on PATH."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    for root in roots:
        candidates = [os.path.join(root, "cu13", "bin", name)]
        candidates += sorted(os.path.join(root, sub, "bin", name) for sub in os.listdir(root))
        for path in candidates:
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    path = shutil.which(name)
    if path:
        return path
    raise RuntimeError(f"{name} not found: install it with `pip install {TOOL_PACKAGES[name]}`")


def _run(tool, *args):
    return subprocess.run([find_tool(tool), *args], check=True, capture_output=True,
                          text=True).stdout


# --- Parsing ----------------------------------------------------------------------------------

# One instruction as nvdisasm prints it:
#     /*0cef0*/   @!UP0 HGMMA.64x64x16.F32.BF16 R56, gdesc[UR52], RZ, !UPT ;
# offset in hex, an optional guard predicate, then the opcode with its dot-separated modifiers.
# The register allocator's spill and refill instructions carry the annotation
# (*"SpillRefill"*) at the end of the line.
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(?:\{\s*)?(?:@!?U?P(?:T|\d+)\s+)?"
                          r"([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def parse_sass(text):
    """``nvdisasm`` text -> [(offset, opcode with modifiers, is a spill/refill), ...]; labels,
    directives and anything else that is not an instruction are skipped."""
    found = []
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            found.append((int(m.group(1), 16), m.group(2), '"SpillRefill"' in line))
    return found


def base_opcode(opcode):
    """"HGMMA.64x64x16.F32.BF16" -> "HGMMA"."""
    return opcode.split(".", 1)[0]


def is_matrix(opcode):
    """Tensor-core instructions: HMMA, IMMA, DMMA, HGMMA, UTCHMMA, UTCQMMA, ... Judged on the
    base opcode only: ``HFMA2.MMA`` is a plain half-precision FMA (a register move, usually)
    that merely issues to the MMA pipe."""
    return "MMA" in base_opcode(opcode)


def _access_bytes(opcode):
    """Bytes one thread moves with a load/store such as STL.64 (default 32 bits)."""
    mods = opcode.split(".")[1:]
    for mod, size in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if mod in mods:
            return size
    return 4


_RES_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def parse_res_usage(text):
    """``cuobjdump -res-usage`` -> dict(registers, stack, shared, local) of the first function
    (cuTile puts one kernel in a cubin)."""
    m = _RES_USAGE.search(text)
    if not m:
        raise ValueError("no resource usage line in cuobjdump output")
    return dict(zip(("registers", "stack", "shared", "local"), map(int, m.groups())))


def _attr(text, name):
    """The value of an ELF attribute (EIATTR_*) in ``cuobjdump -elf`` output, or None."""
    m = re.search(rf"Attribute:\s*{name}\s*\n\s*Format:[^\n]*\n\s*Value:([^\n]*)", text)
    return m.group(1).split() if m else None


def parse_elf_attributes(text):
    """The attributes of ``cuobjdump -elf`` that say how the kernel runs:

    threads      EIATTR_REQNTID, the block size the compiler built the kernel for (cuTile
                 picks it; on sm_100 it adds warps of its own for the tcgen05 pipeline)
    max_regs     EIATTR_MAXREG_COUNT, the register cap it compiled under (an occupancy hint
                 such as ``occupancy=3`` lowers it)
    mbarriers    EIATTR_NUM_MBARRIERS, shared-memory barriers of the async pipelines
    tcgen05      the EIATTR_TCGEN05_*_USED flags (Blackwell tensor memory / MMA in use)
    """
    reqntid = _attr(text, "EIATTR_REQNTID")
    maxreg = _attr(text, "EIATTR_MAXREG_COUNT")
    mbar = _attr(text, "EIATTR_NUM_MBARRIERS")
    return dict(
        threads=(int(reqntid[0], 16) * int(reqntid[1], 16) * int(reqntid[2], 16)
                 if reqntid else None),
        max_regs=int(maxreg[0], 16) if maxreg else None,
        # 0xffff: the compiler could not count them (barrier addresses computed at run time).
        mbarriers=(None if mbar and int(mbar[0], 16) == 0xffff
                   else int(mbar[0], 16) if mbar else 0),
        tcgen05=sorted(set(re.findall(r"EIATTR_TCGEN05_(\w+?)_USED", text))),
    )


def tcgen05_shapes(elf_text):
    """{"M64xN128": count} of the tcgen05.mma instructions, read from the PTX that TileIR
    embeds in the cubin (section .nv_debug_ptx_txt, printed by ``cuobjdump -elf``).

    Blackwell's SASS shows a bare ``UTCHMMA``: the shape sits in the instruction descriptor,
    a 32-bit operand that the PTX sets from a constant (``mov.b32 %r, <idesc>``). Its bits
    17-22 hold N / 8 and bits 24-28 M / 16 (PTX ISA, "Instruction descriptor"). M matters:
    a 64-row MMA uses half of the 128 lanes of tensor memory and of the tensor core."""
    shapes = collections.Counter()
    for operands in re.findall(r"tcgen05\.mma[\w:.]*\s+([^;]*);", elf_text):
        idesc = operands.split(",")[3].strip()
        m = re.search(rf"mov\.b32\s+{re.escape(idesc)},\s*(\d+);", elf_text)
        if m:
            value = int(m.group(1))
            shapes[f"M{((value >> 24) & 31) * 16}xN{((value >> 17) & 63) * 8}"] += 1
        else:
            shapes["shape set at run time"] += 1
    return dict(shapes)


# --- The report --------------------------------------------------------------------------------

# Instruction counts worth a row: (row, patterns). A pattern is a base opcode ("LDG"), a full
# opcode prefix ("MUFU.EX2") or a base-opcode prefix ("UTMA*").
COUNTED = [
    ("TMA load / store", ("UTMALDG",), ("UTMASTG", "UTMAREDG")),  # tensor-map copies, sm_90+
    ("LDGSTS (cp.async)", ("LDGSTS",)),   # global -> shared, per thread, no registers; sm_80+
    ("LDG / STG global", ("LDG",), ("STG",)),
    ("LDS / STS shared", ("LDS",), ("STS",)),
    ("LDSM / STSM matrix", ("LDSM",), ("STSM",)),  # ldmatrix / stmatrix (shared <-> registers)
    ("LDTM / STTM tmem", ("LDTM",), ("STTM",)),    # tensor memory <-> registers, sm_100
    ("BAR / SYNCS (mbarrier)", ("BAR",), ("SYNCS",)),
    ("MUFU.EX2 (exp2)", ("MUFU.EX2",)),
    # float32 arithmetic; the "2" forms (sm_100) do two operations in one instruction.
    ("FFMA / FMUL / FADD", ("FFMA", "FFMA2"), ("FMUL", "FMUL2"), ("FADD", "FADD2")),
]


def _matches(pattern, opcode):
    if pattern.endswith("*"):
        return base_opcode(opcode).startswith(pattern[:-1])
    if "." in pattern:
        return opcode == pattern or opcode.startswith(pattern + ".")
    return base_opcode(opcode) == pattern


def count(opcodes, patterns):
    """How many instructions of a Counter {opcode: n} match any of ``patterns``."""
    return sum(n for op, n in opcodes.items() if any(_matches(p, op) for p in patterns))


@dataclasses.dataclass
class SassReport:
    """What one kernel variant compiles to on one architecture."""
    label: str                 # the variant, e.g. "compute_out" or "compute_out[block_m=128]"
    arch: str                  # "sm_90", ...
    instructions: int          # static instruction count, all functions of the cubin
    registers: int             # per thread
    max_regs: int | None       # the cap the compiler was given
    threads: int | None        # per block
    shared: int                # static shared memory bytes per block
    stack: int                 # stack frame bytes per thread (spills live there)
    local_loads: int           # LDL instructions
    local_stores: int          # STL instructions
    spill_loads: int           # ... of them marked as register refills by the compiler
    spill_stores: int          # ... and as register spills
    spill_load_bytes: int      # bytes one thread moves with all spill loads, counted once each
    spill_store_bytes: int     # (what `ptxas -v` reports as "bytes spill stores/loads")
    mbarriers: int | None      # None: not counted by the compiler
    tcgen05: list              # EIATTR_TCGEN05_*_USED flags, e.g. ["1CTA"]
    tcgen05_mma: dict          # sm_100: {"M64xN128": count} (see tcgen05_shapes)
    opcodes: collections.Counter = dataclasses.field(repr=False)  # full opcode -> count

    @property
    def column(self):
        return f"{self.label}@{self.arch}"

    @property
    def mma(self):
        """{matrix opcode with modifiers: count}, e.g. {"HGMMA.64x64x16.F32.BF16": 32}."""
        return {op: n for op, n in sorted(self.opcodes.items()) if is_matrix(op)}

    @property
    def mma_count(self):
        return sum(self.mma.values())

    def count(self, *patterns):
        return count(self.opcodes, patterns)

    def rows(self):
        """[(metric, value as text)], the content of ``summary`` and of ``compare``."""
        mma = ", ".join(f"{n} {op}" for op, n in self.mma.items()) or "none"
        rows = [
            ("instructions", str(self.instructions)),
            ("threads / block", str(self.threads)),
            ("registers / thread", f"{self.registers} (cap {self.max_regs})"),
            ("shared memory B", str(self.shared)),
            ("stack frame B", str(self.stack)),
            ("spill st / ld instr", f"{self.spill_stores} / {self.spill_loads}"),
            ("spill st / ld bytes", f"{self.spill_store_bytes} / {self.spill_load_bytes}"),
            ("mbarriers", "?" if self.mbarriers is None else str(self.mbarriers)),
            ("tcgen05", ", ".join(self.tcgen05) or "-"),
            ("mma instructions", mma),
            ("tcgen05.mma shapes",
             ", ".join(f"{n} {shape}" for shape, n in self.tcgen05_mma.items()) or "-"),
        ]
        for name, *groups in COUNTED:
            rows.append((name, " / ".join(str(count(self.opcodes, g)) for g in groups)))
        return rows

    def summary(self):
        rows = [("variant", self.column)] + self.rows()
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    __str__ = summary


def compare_table(reports):
    """The reports side by side as text: one row per metric, one column per variant@arch."""
    columns = [r.column for r in reports]
    names = [name for name, _ in reports[0].rows()]
    cells = [dict(r.rows()) for r in reports]
    width0 = max(map(len, names))
    widths = [max([len(col)] + [len(c[n]) for n in names]) for col, c in zip(columns, cells)]
    lines = ["  ".join([" " * width0] + [col.rjust(w) for col, w in zip(columns, widths)])]
    for n in names:
        lines.append("  ".join([n.ljust(width0)] + [c[n].rjust(w) for c, w in zip(cells, widths)]))
    return "\n".join(lines)


def compare(reports):
    """Print the reports side by side (for notebooks; ``compare_table`` returns the text)."""
    print(compare_table(list(reports)))


def _read_cubin(cubin, *commands):
    """The output of each (tool, flags...) command run on ``cubin``, written to a file once."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return [_run(tool, *flags, path) for tool, *flags in commands]


def analyze_cubin(cubin, arch, label="kernel"):
    """Disassemble a cubin and summarise it (``SassReport``)."""
    code, usage, elf = _read_cubin(cubin, ("nvdisasm", "-c"), ("cuobjdump", "-res-usage"),
                                   ("cuobjdump", "-elf"))
    usage = parse_res_usage(usage)
    attrs = parse_elf_attributes(elf)
    instructions = parse_sass(code)
    opcodes = collections.Counter(op for _, op, _ in instructions)
    # Spills: the local-memory accesses the compiler annotated as spill/refill. (Other local
    # accesses would be arrays the kernel indexes dynamically; cuTile kernels rarely have any.)
    spills = [op for _, op, spill in instructions if spill]
    loads = [op for op in spills if base_opcode(op) == "LDL"]
    stores = [op for op in spills if base_opcode(op) == "STL"]
    return SassReport(
        label=label, arch=arch, instructions=len(instructions),
        registers=usage["registers"], max_regs=attrs["max_regs"], threads=attrs["threads"],
        shared=usage["shared"], stack=usage["stack"],
        local_loads=count(opcodes, ["LDL"]), local_stores=count(opcodes, ["STL"]),
        spill_loads=len(loads), spill_stores=len(stores),
        spill_load_bytes=sum(map(_access_bytes, loads)),
        spill_store_bytes=sum(map(_access_bytes, stores)),
        mbarriers=attrs["mbarriers"], tcgen05=attrs["tcgen05"], tcgen05_mma=tcgen05_shapes(elf),
        opcodes=opcodes)


def kernel_name(kernel):
    name = kernel_function(kernel).__name__
    return name[:-len("_kernel")] if name.endswith("_kernel") else name


# A compile takes seconds: keep every report of this process, keyed by what the compiler sees
# (the kernel, its full signature with the constants' values, and the architecture).
_CACHE = {}


def sass_report(kernel, args, arch, label=None, specialize=True):
    """Compile one launch's variant of ``kernel`` (arguments as the ``*_plan`` functions build
    them; meta tensors do) for ``arch`` and report on its machine code. ``specialize``: see
    ``ops.tools.aot.compile_cubin``."""
    signature = launch_signature(kernel, args) if specialize else signature_of(kernel, args)
    key = (kernel, repr(signature), arch)
    if key not in _CACHE:
        cubin = compile_cubin(kernel, args, arch, specialize=specialize)
        _CACHE[key] = analyze_cubin(cubin, arch, kernel_name(kernel))
    return dataclasses.replace(_CACHE[key], label=label or kernel_name(kernel))


# --- Fingerprints of the pipeline's machine code ------------------------------------------------

def pipeline_launches(seqlen=1024, nheads=4, headdim=64, dstate=128, chunk_size=256,
                      dtype=torch.bfloat16):
    """Every distinct launch (kernel, arguments) that a training step and an inference call of
    ``ops.mamba_chunk_scan_combined`` make at this shape, at the default configs, in order.

    The calls run on the CPU with ``ops.runtime.launch.launch`` replaced by a recorder, so no kernel is
    executed (their outputs stay unwritten): what a kernel compiles to depends only on the
    arguments' dtypes, sizes, strides and constants. The training step has every option (D per
    head, z, dt bias and softplus, initial states, packed sequences, final states); the inference
    call D and the dt options only; the core kernels of ``ops.core`` run once too."""
    seen, launches = set(), []

    def record(grid, kernel, args, stream=None):
        key = (kernel, repr(launch_signature(kernel, args)))
        if key not in seen:
            seen.add(key)
            launches.append((kernel, tuple(args)))

    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    b, L, h, p, n = 1, seqlen, nheads, headdim, dstate
    x, z, dout = rand(b, L, h, p), rand(b, L, h, p), rand(b, L, h, p)
    B, C = rand(b, L, 1, n), rand(b, L, 1, n)
    dt, dt_bias, D = rand(b, L, h, dt=torch.float32), rand(h, dt=torch.float32), rand(h, dt=torch.float32)
    A = -torch.rand(h, generator=gen) - 0.5
    init = rand(b, h, p, n, dt=torch.float32)
    seq_idx = (torch.arange(L) >= L // 3).to(torch.int32)[None]
    original = launch_module.launch
    launch_module.launch = record
    try:
        leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, z, dt_bias, init)]
        out, final = mamba_chunk_scan_combined(
            *leaves[:5], chunk_size, D=leaves[5], z=leaves[6], dt_bias=leaves[7],
            initial_states=leaves[8], seq_idx=seq_idx, dt_softplus=True,
            return_final_states=True, backend="interpret")
        torch.autograd.backward((out, final), (dout, torch.ones_like(final)))
        with torch.no_grad():
            mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                                      dt_softplus=True, backend="interpret")
        core_forward(x, dt.abs() + 0.01, A, B, C, chunk_size)
    finally:
        launch_module.launch = original
    return launches


def sass_fingerprints(arch="sm_90", **shape):
    """[(kernel name, signature digest, SASS digest)] of ``pipeline_launches(**shape)``, each
    launch compiled for ``arch`` as a launch specializes it. The SASS digest is the SHA-256 of
    nvdisasm's listing of the code: equal digests mean identical machine code. Used to show that
    a change that should not touch the kernels (moving modules, renaming helpers) did not."""
    rows = []
    for kernel, args in pipeline_launches(**shape):
        cubin = compile_cubin(kernel, args, arch)
        code, = _read_cubin(cubin, ("nvdisasm", "-c"))     # code only: one line per instruction
        signature = repr(launch_signature(kernel, args))
        rows.append((kernel_name(kernel), hashlib.sha256(signature.encode()).hexdigest()[:12],
                     hashlib.sha256(code.encode()).hexdigest()[:16]))
    return rows


# --- Command line ------------------------------------------------------------------------------

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _value(text):
    """--set values: Python literals (128, True, None), else a torch dtype name, else text."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return getattr(torch, text) if isinstance(getattr(torch, text, None), torch.dtype) else text


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ops.tools.sass", description=(
        "Compile the project's kernels for GPU architectures (no GPU needed) and report what "
        "their machine code contains: matrix instructions, registers, spills, shared memory."))
    parser.add_argument("kernels", nargs="*", default=list(KERNELS), metavar="KERNEL",
                        help=f"any of {', '.join(KERNELS)} (default: all)")
    parser.add_argument("--arch", default="sm_90,sm_100",
                        help="comma-separated architectures (default: sm_90,sm_100)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="input dtype")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="keyword argument of the *_plan function, e.g. block_m=128 "
                             "(repeatable; names are case-insensitive)")
    parser.add_argument("--generic", action="store_true",
                        help="compile for arbitrary arrays (ops.tools.aot's signature) instead of "
                             "specializing on contiguous, aligned tensors as a launch does")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="also list the N most frequent opcodes of each variant")
    parser.add_argument("--fingerprint", action="store_true",
                        help="instead: one line per distinct launch of a training step and an "
                             "inference call at the default configs, with the SHA-256 of its "
                             "machine code for each --arch (sass_fingerprints)")
    a = parser.parse_args(argv)
    if a.fingerprint:
        for arch in a.arch.split(","):
            for name, signature, digest in sass_fingerprints(arch.strip()):
                print(f"{arch.strip()}  {name:<28} signature {signature}  sass {digest}")
        return
    for name in a.kernels:
        if name not in KERNELS:
            parser.error(f"unknown kernel {name!r}; choose from {', '.join(KERNELS)}")
    overrides = {}
    for item in a.set:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected NAME=VALUE")
        overrides[name.strip().lower()] = _value(value.strip())
    accepted = {p.name for k in a.kernels for p in plan_options(k)}
    if set(overrides) - accepted:
        parser.error(f"--set {', '.join(sorted(set(overrides) - accepted))}: not an option of "
                     f"the chosen kernels' plan functions ({', '.join(sorted(accepted))})")

    reports = []
    for name in a.kernels:
        # Each kernel takes the overrides its plan function knows (block_m is compute_out's).
        options = {k: v for k, v in overrides.items() if k in {p.name for p in plan_options(name)}}
        kernel, args = representative_plan(name, DTYPES[a.dtype], **options)
        label = name + ("[" + ",".join(f"{k}={v}" for k, v in options.items()) + "]"
                        if options else "")
        for arch in a.arch.split(","):
            reports.append(sass_report(kernel, args, arch.strip(), label,
                                       specialize=not a.generic))
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    kind = "arbitrary arrays" if a.generic else "contiguous aligned tensors"
    print(f"# {a.dtype}, {shape}, {kind}; static instruction counts")
    compare(reports)
    for r in reports if a.top else []:
        top = ", ".join(f"{op} {n}" for op, n in r.opcodes.most_common(a.top))
        print(f"\n{r.column}: {top}")


if __name__ == "__main__":
    sys.exit(main())
