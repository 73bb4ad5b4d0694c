"""Ahead-of-time compilation of a kernel launch, for any GPU architecture, on any machine.

cuTile compiles a kernel separately for every combination of constant parameters (tile sizes,
feature flags) and argument dtypes. ``signature_of`` turns the arguments of a launch (as the
launchers' ``*_plan`` functions build them; tensors on the "meta" device will do, they have
shapes and dtypes but no memory) into the kernel signature that launch would compile, and
``compile_cubin`` compiles it to a cubin for an architecture such as "sm_90" -- no GPU needed.
``launch_signature`` adds what a real launch knows about contiguous, aligned tensors (unit
strides, 16-byte divisibility and alignment), which changes the code a lot: it is what runs.

The signature mirrors what a launch would use: every tensor becomes an array with its dtype
and rank, 64-bit indices where the kernel parameter is annotated ``ct.IndexedWithInt64``,
non-negative strides and no aliasing; Python ints become int32 scalars, Python floats float32
scalars (the kernels cast float scalars explicitly, so a 64-bit one works too); constants
(``ct.Constant``) are passed by value.
"""
import inspect
import io
import typing

import torch

import cuda.tile as ct
from cuda.tile import compilation as cc

from ops.runtime.cutile_internals import kernel_function

ARCHS = ["sm_80", "sm_90", "sm_100"]
CT_DTYPE = {torch.float32: ct.float32, torch.float16: ct.float16, torch.bfloat16: ct.bfloat16,
            torch.float64: ct.float64, torch.int32: ct.int32, torch.int64: ct.int64}


def _index_dtype(annotation):
    if typing.get_origin(annotation) is typing.Annotated:
        for meta in annotation.__metadata__:
            if isinstance(meta, ct.ArrayAnnotation):
                return meta.index_dtype
    return ct.int32


def _is_constant(annotation):
    return (typing.get_origin(annotation) is typing.Annotated
            and any(isinstance(m, ct.ConstantAnnotation) for m in annotation.__metadata__))


def signature_of(kernel, args):
    """The KernelSignature a launch of ``kernel`` with ``args`` compiles."""
    params = inspect.signature(kernel_function(kernel)).parameters.values()
    constraints = []
    for param, arg in zip(params, args, strict=True):
        if _is_constant(param.annotation):
            constraints.append(arg)
        elif isinstance(arg, torch.Tensor):
            constraints.append(cc.ArrayConstraint(
                CT_DTYPE[arg.dtype], arg.dim(), index_dtype=_index_dtype(param.annotation),
                stride_lower_bound_incl=0, alias_groups=[], may_alias_internally=False))
        elif isinstance(arg, bool):
            raise TypeError(f"{param.name}: a bool kernel argument should be a ct.Constant")
        elif isinstance(arg, int):
            constraints.append(cc.ScalarConstraint(ct.int32))
        elif isinstance(arg, float):
            constraints.append(cc.ScalarConstraint(ct.float32))
        else:
            raise TypeError(f"{param.name}: unexpected argument {arg!r}")
    return cc.KernelSignature(constraints, calling_convention=cc.CallingConvention.cutile_python_v1())


def launch_signature(kernel, args):
    """The signature a launch on a GPU would compile for these arguments.

    ``signature_of`` assumes only what holds for every array (any strides, any
    alignment), which is right for a kernel exported once for unknown callers. A launch knows
    more, and cuTile specializes the kernel on it: an axis of stride 1 becomes a constant
    stride, strides and sizes that are multiples of 16 bytes / 16 elements are declared so,
    the base address is 16-byte aligned and the elements of one array do not overlap. With
    those facts the compiler can use 16-byte vector loads and asynchronous copies; without
    them every element is a separate, bounds-checked 2-byte load. So the code that runs is
    only seen with this signature. Here it is rebuilt from the arguments' shapes and strides
    (meta tensors have both), assuming what holds for the contiguous tensors the launchers
    receive: a freshly allocated tensor starts 16-byte aligned. Size-one axes, which a launch
    may also turn into constants, are left alone (that needs a newer calling convention).
    """
    signature = signature_of(kernel, args)
    params = []
    for constraint, arg in zip(signature.parameters, args, strict=True):
        if isinstance(arg, torch.Tensor):
            size = arg.element_size()
            vector = 16 // size if 16 % size == 0 else 1     # elements in 16 bytes
            constraint = cc.ArrayConstraint(
                constraint.dtype, constraint.ndim, index_dtype=constraint.index_dtype,
                stride_lower_bound_incl=0, alias_groups=[], may_alias_internally=False,
                stride_constant=[1 if st == 1 else None for st in arg.stride()],
                stride_divisible_by=[vector if st != 1 and st * size % 16 == 0 else 1
                                     for st in arg.stride()],
                shape_divisible_by=[16 if d % 16 == 0 else 1 for d in arg.shape],
                base_addr_divisible_by=16)
        params.append(constraint)
    return cc.KernelSignature(params, calling_convention=signature.calling_convention)


def compile_cubin(kernel, args, arch, specialize=True):
    """Compile one launch's variant of ``kernel`` for ``arch`` (e.g. "sm_90"); returns the cubin.

    ``specialize=True`` (default) compiles what a launch with these arguments would run
    (``launch_signature``); ``False``, a kernel for arbitrary arrays (``signature_of``).
    """
    signature = launch_signature(kernel, args) if specialize else signature_of(kernel, args)
    buf = io.BytesIO()
    cc.export_kernel(kernel, [signature], buf, gpu_code=arch, output_format="cubin")
    return buf.getvalue()
