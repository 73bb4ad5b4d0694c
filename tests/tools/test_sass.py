"""What the kernels compile to on Hopper (sm_90) and Blackwell (sm_100), checked on a CPU.

Each project kernel is compiled as a launch would compile it (``ops.tools.sass``: contiguous,
aligned tensors at a Mamba-2-like shape) and its machine code is read with nvdisasm and
cuobjdump. The assertions pin down what the compiler does today:

  * matrix products run on the tensor cores of the architecture: warpgroup ``HGMMA`` (wgmma)
    on sm_90, ``UTCHMMA`` (tcgen05.mma, accumulator in tensor memory, read back with ``LDTM``)
    on sm_100, never the other's, and none in chunk_cumsum, which has no product;
  * operands reach shared memory asynchronously (cp.async or TMA) behind mbarriers;
  * resources are sane. Spills are reported by ``ops.tools.sass`` but not asserted away: at the
    time of writing compute_out spills a few registers on sm_100 (``python -m ops.tools.sass``
    prints the counts).

Small kernels of this file show three effects worth knowing when reading the big ones.
"""
import pytest
import torch

import cuda.tile as ct
from ops.tools import sass
from ops.tools.plans import representative_plan

ARCHS = ["sm_90", "sm_100"]
MMA_KIND = {"sm_90": "HGMMA", "sm_100": "UTCHMMA"}


@pytest.fixture(scope="module")
def reports():
    """(kernel, arch) -> SassReport, each compiled once (a compile takes seconds)."""
    cache = {}

    def get(name, arch):
        if (name, arch) not in cache:
            kernel, args = representative_plan(name)
            cache[name, arch] = sass.sass_report(kernel, args, arch)
        return cache[name, arch]
    return get


# --- The parser, on a fixed sample -------------------------------------------------------------

# Lines of real nvdisasm output (compute_out: sm_90 and sm_100, chunk_cumsum: sm_80), with a
# label and a directive that are not instructions.
SASS_SAMPLE = """\
\t.section\t.text.compute_out_kernel,"ax",@progbits
.L_x_798:
        /*00d0*/                   VOTEU.ALL UP0, P0 ;
        /*00f0*/                   @!UP0 S2UR UR7, SR_CgaCtaId ;
        /*0270*/                   HFMA2.MMA R16, -RZ, RZ, 0, 0 ;
        /*cea0*/                   WARPGROUP.ARRIVE ;
        /*cef0*/                   HGMMA.64x64x16.F32.BF16 R56, gdesc[UR52], RZ, !UPT ;
        /*d030*/                   HGMMA.64x64x16.F32.BF16 R56, gdesc[UR4], R56 ;
        /*ff80*/                   STL.64 [R1+0x148], R90                    (*"SpillRefill"*);
        /*10180*/                   MUFU.EX2 R45, R37 ;
        /*10190*/                   LDTM.16dp32bit_t0_t15.x32 R4, tmem[UR24] ;
        /*101c0*/              @!P0 FMUL R45, R45, R45 ;
        /*435d0*/                   UTCHMMA gdesc[UR8], gdesc[UR4], tmem[UR7], tmem[UR16], idesc[UR17], !UPT ;
"""


def test_parse_sass_sample():
    parsed = sass.parse_sass(SASS_SAMPLE)
    assert [op for _, op, _ in parsed] == [
        "VOTEU.ALL", "S2UR", "HFMA2.MMA", "WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16",
        "HGMMA.64x64x16.F32.BF16", "STL.64", "MUFU.EX2", "LDTM.16dp32bit_t0_t15.x32", "FMUL",
        "UTCHMMA"]
    assert parsed[0][0] == 0xd0 and parsed[-1][0] == 0x435d0
    assert [op for _, op, spill in parsed if spill] == ["STL.64"]
    # HFMA2.MMA is an FMA issued to the MMA pipe, not a matrix instruction.
    assert [op for _, op, _ in parsed if sass.is_matrix(op)] == [
        "HGMMA.64x64x16.F32.BF16", "HGMMA.64x64x16.F32.BF16", "UTCHMMA"]


def test_parse_resources_sample():
    usage = sass.parse_res_usage(
        " Function compute_out_kernel_Kt1:\n"
        "  REG:168 STACK:432 SHARED:76048 LOCAL:0 CONSTANT[0]:1212 TEXTURE:0 SURFACE:0\n")
    assert usage == dict(registers=168, stack=432, shared=76048, local=0)
    attrs = sass.parse_elf_attributes(
        "\t<0x93>\n\tAttribute:\tEIATTR_TCGEN05_1CTA_USED\n\tFormat:\tEIFMT_HVAL\n"
        "\t<0x95>\n\tAttribute:\tEIATTR_MAXREG_COUNT\n\tFormat:\tEIFMT_HVAL\n\tValue:\t0xa8\n"
        "\t<0x9a>\n\tAttribute:\tEIATTR_NUM_MBARRIERS\n\tFormat:\tEIFMT_SVAL\n\tValue:\t0xd\n"
        "\t<0x9c>\n\tAttribute:\tEIATTR_REQNTID\n\tFormat:\tEIFMT_SVAL\n"
        "\tValue:\t0x100 0x1 0x1 \n")
    assert attrs == dict(threads=256, max_regs=168, mbarriers=13, tcgen05=["1CTA"])


def test_tcgen05_shapes_sample():
    # PTX as TileIR embeds it: the instruction descriptor (4th operand) is set from a constant.
    # 135267472 = 0x0810_0490: bits 24-28 = 8 (M = 128), bits 17-22 = 8 (N = 64), bf16 -> f32.
    ptx = ("mov.b32 \t%r3628, 135267472;\n"
           "tcgen05.mma.cta_group::1.kind::f16.collector::a::discard [%r3832], %rd248, %rd1962, "
           "%r3628, {%r3627, %r3627, %r3627, %r3627}, %p1052;\n"
           "tcgen05.mma.cta_group::1.kind::f16 [%r3832], %rd250, %rd1963, %r3628, %p1055;\n")
    assert sass.tcgen05_shapes(ptx) == {"M128xN64": 2}


def test_missing_tool_names_the_pip_package(monkeypatch):
    monkeypatch.setattr(sass.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(sass.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install nvidia-cuda-nvdisasm"):
        sass.find_tool("nvdisasm")


# --- The project's kernels ---------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["fwd_pass_state", "compute_out"])
def test_products_run_on_the_architectures_tensor_cores(reports, name, arch):
    r = reports(name, arch)
    kinds = {sass.base_opcode(op) for op in r.mma}
    assert kinds == {MMA_KIND[arch]}, r.summary()
    if arch == "sm_90":
        # wgmma names its shape and types: fp32 accumulator, bf16 operands.
        assert all(op.endswith(".F32.BF16") for op in r.mma), r.mma
    else:
        # tcgen05: the shape and types sit in an instruction descriptor register (idesc), so
        # SASS shows a bare UTCHMMA; the accumulator lives in tensor memory and is read back.
        # The descriptors are compile-time constants, so the embedded PTX gives the shapes.
        assert r.tcgen05 and r.count("LDTM") > 0, r.summary()
        assert sum(r.tcgen05_mma.values()) == r.mma_count
        assert all(shape.startswith(("M64x", "M128x")) for shape in r.tcgen05_mma), r.tcgen05_mma
    # The operands are copied into shared memory asynchronously, behind mbarriers.
    assert r.count("LDGSTS", "UTMALDG") > 0 and r.mbarriers > 0, r.summary()
    assert r.shared > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sass.KERNELS)
def test_resources_are_sane(reports, name, arch):
    r = reports(name, arch)
    print(r.summary())                      # shown with pytest -s: spills included
    assert 0 < r.registers <= 255 and r.max_regs <= 255
    assert r.threads and r.threads % 128 == 0          # whole warpgroups
    assert r.instructions > 100
    assert r.count("MUFU.EX2") > 0                     # every kernel decays with exp2
    # Spills are local-memory accesses; each moves 4, 8 or 16 bytes.
    assert r.spill_stores <= r.local_stores and r.spill_loads <= r.local_loads
    assert 4 * r.spill_stores <= r.spill_store_bytes <= 16 * r.spill_stores
    if name == "chunk_cumsum":
        assert r.mma == {} and r.spill_stores == 0


def test_cli_overrides_plan_options(capsys):
    sass.main(["chunk_cumsum", "--arch", "sm_90", "--set", "BLOCK_H=8"])
    out = capsys.readouterr().out
    assert "chunk_cumsum[block_h=8]@sm_90" in out and "mma instructions" in out
    with pytest.raises(SystemExit):
        sass.main(["chunk_cumsum", "--set", "no_such_option=1"])


# --- Small kernels: what the operand layout, the index type and the dtype change -----------------

@ct.kernel
def mma_probe(a, b, c, TRANSPOSE_A: ct.Constant[bool], TRANSPOSE_B: ct.Constant[bool],
              TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
              NK: ct.Constant[int]):
    """c = a @ b, one (TM, TN) tile per block; a is stored (K, M) when TRANSPOSE_A, b (N, K)
    when TRANSPOSE_B, and the loaded tiles are transposed back."""
    m = ct.bid(0)
    n = ct.bid(1)
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(NK):
        if TRANSPOSE_A:
            x = ct.transpose(ct.load(a, index=(k, m), shape=(TK, TM)))
        else:
            x = ct.load(a, index=(m, k), shape=(TM, TK))
        if TRANSPOSE_B:
            y = ct.transpose(ct.load(b, index=(n, k), shape=(TN, TK)))
        else:
            y = ct.load(b, index=(k, n), shape=(TK, TN))
        acc = ct.mma(x, y, acc)
    ct.store(c, index=(m, n), tile=acc)


@ct.kernel
def mma_probe_int64(a: ct.IndexedWithInt64, b: ct.IndexedWithInt64, c,
                    TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
                    NK: ct.Constant[int]):
    """mma_probe without transposes, with a and b indexed in 64 bits (as the project's
    sequence-long arrays are)."""
    m = ct.bid(0)
    n = ct.bid(1)
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(NK):
        acc = ct.mma(ct.load(a, index=(m, k), shape=(TM, TK)),
                     ct.load(b, index=(k, n), shape=(TK, TN)), acc)
    ct.store(c, index=(m, n), tile=acc)


def probe_args(dtype=torch.bfloat16, ta=False, tb=False, tk=64):
    def meta(*shape, dt=dtype):
        return torch.empty(shape, dtype=dt, device="meta")
    return (meta(256, 256), meta(256, 256), meta(256, 256, dt=torch.float32), ta, tb,
            64, 64, tk, 256 // tk)


@pytest.mark.parametrize("arch", ARCHS)
def test_transposed_operands_cost_nothing(arch):
    """16-bit operands: a transposed load feeds the same MMA instructions, because wgmma and
    tcgen05 read the operands from shared memory through descriptors that carry the layout
    (K-major or MN-major), so no data is moved to transpose."""
    plain = sass.sass_report(mma_probe, probe_args(), arch)
    both = sass.sass_report(mma_probe, probe_args(ta=True, tb=True), arch)
    # Each k-step of 64 is 4 instructions of K = 16; the 4 steps are unrolled.
    assert plain.mma == both.mma and plain.mma_count == 16
    assert plain.tcgen05_mma == both.tcgen05_mma == ({"M64xN64": 16} if arch == "sm_100" else {})
    assert abs(plain.instructions - both.instructions) < 0.1 * plain.instructions


def test_64_bit_indexing_trades_tma_for_cp_async():
    """With 32-bit indices the operand tiles arrive by TMA (UTMALDG, one thread issues a whole
    tile); an ``IndexedWithInt64`` array is copied by every thread with LDGSTS (cp.async)
    instead. The project's kernels index the sequence-long arrays in 64 bits, hence no TMA
    loads there."""
    args = probe_args()
    tma = sass.sass_report(mma_probe, args, "sm_90")
    cp_async = sass.sass_report(mma_probe_int64, args[:3] + args[5:], "sm_90")
    assert tma.count("UTMALDG") > 0 and tma.count("LDGSTS") == 0
    assert cp_async.count("UTMALDG") == 0 and cp_async.count("LDGSTS") > 0
    assert cp_async.mma == tma.mma


@ct.kernel
def axes_probe_5(src, b, c, T: ct.Constant[int]):
    """c = (one (T, T) tile of a five-axis array) @ b, per block."""
    tile = ct.reshape(ct.load(src, index=(ct.bid(0), 0, 0, 0, 0), shape=(1, 1, 1, T, T)), (T, T))
    acc = ct.mma(tile, ct.load(b, index=(0, 0), shape=(T, T)), ct.zeros((T, T), dtype=ct.float32))
    ct.store(c, index=(ct.bid(0), 0), tile=acc)


@ct.kernel
def axes_probe_6(src, b, c, T: ct.Constant[int]):
    """axes_probe_5 with one more (unit) axis in front of the array."""
    tile = ct.reshape(ct.load(src, index=(0, ct.bid(0), 0, 0, 0, 0), shape=(1, 1, 1, 1, T, T)),
                      (T, T))
    acc = ct.mma(tile, ct.load(b, index=(0, 0), shape=(T, T)), ct.zeros((T, T), dtype=ct.float32))
    ct.store(c, index=(ct.bid(0), 0), tile=acc)


def test_more_than_five_axes_trade_tma_for_cp_async():
    """A tensor map has at most five dimensions: the same operand tile of the same bytes
    arrives by TMA (UTMALDG) from a five-axis array and by loads every thread issues from a
    six-axis one (LDG here; cp.async, LDGSTS, where the compiler pipelines them in a loop, as
    in the states launch before its d(C B^T) partials lost their sixth axis).
    Hence every array the project's kernels read has at most five axes (the pair kernel's
    d(C B^T) partials fold their splits into the batch axis:
    ``bwd_compute_out.dcb_tile``; ``test_every_launch_passes_arrays_of_at_most_five_axes``)."""
    meta = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")
    b, c = meta(64, 64), meta(256, 64, dt=torch.float32)
    five = sass.sass_report(axes_probe_5, (meta(4, 2, 2, 64, 64), b, c, 64), "sm_90")
    six = sass.sass_report(axes_probe_6, (meta(1, 4, 2, 2, 64, 64), b, c, 64), "sm_90")
    assert five.mma == six.mma
    per_thread = ("LDG", "LDGSTS")
    assert five.count("UTMALDG") == 2 and five.count(*per_thread) == 0     # both operands
    assert six.count("UTMALDG") == 1 and six.count(*per_thread) > 0        # b's alone


def test_every_launch_passes_arrays_of_at_most_five_axes():
    """Every launch of a training step and an inference call (every option on, at dstate 128
    and 256: ``sass.pipeline_launches``) hands its kernels tensors of at most five axes, so
    that none of their loads falls back from TMA to cp.async for want of a tensor map
    (``test_more_than_five_axes_trade_tma_for_cp_async``)."""
    for dstate in (128, 256):
        for kernel, args in sass.pipeline_launches(seqlen=512, nheads=8, dstate=dstate,
                                                   chunk_size=128):
            axes = [a.dim() for a in args if isinstance(a, torch.Tensor)]
            assert max(axes) <= 5, (sass.kernel_name(kernel), axes)


def test_launch_specialization_is_what_makes_fast_code():
    """Compiled for arbitrary arrays (``ops.tools.aot``'s signature) the same kernel loads every
    element with a separate 2-byte load; specialized on contiguous, aligned tensors, as a
    launch does, it copies tiles with TMA and is an order of magnitude shorter."""
    fast = sass.sass_report(mma_probe, probe_args(), "sm_90")
    generic = sass.sass_report(mma_probe, probe_args(), "sm_90", specialize=False)
    assert generic.count("LDG.E.U16") > 0 and generic.count("UTMALDG") == 0
    assert fast.count("UTMALDG") > 0 and fast.count("LDG.E.U16") == 0
    assert generic.instructions > 5 * fast.instructions


def test_float32_mma_is_not_on_tensor_cores():
    """float32 operands (no tf32 rounding) leave the tensor cores out: the product is computed
    with separate FMUL and FADD instructions, one of each per multiply-add (not even FFMA,
    which would round once instead of twice)."""
    r = sass.sass_report(mma_probe, probe_args(torch.float32, tk=16), "sm_90")
    assert r.mma == {}
    assert r.count("FFMA", "FFMA2") == 0
    macs_per_step = 64 * 64 * 16 // r.threads        # one k-step's multiply-adds per thread
    assert r.count("FMUL") >= macs_per_step and r.count("FADD") >= macs_per_step
