"""ops/runtime/cutile_internals.py: the one module that uses cuda.tile's private names."""
import pytest

import cuda.tile as ct

from ops.runtime import cutile_internals
from ops.runtime.cutile_internals import stub_module
from ops.interpreter.registry import OPS
from ops import examples as ek


@pytest.mark.parametrize("version", ["1.7.0", "1.7.5", "1.7.0rc1"])
def test_supported_versions_are_accepted(version):
    cutile_internals.check_version(version)


@pytest.mark.parametrize("version", ["1.6.0", "1.8.0", "2.0.0", "1.10.0", "nightly"])
def test_unsupported_versions_are_refused_naming_them(version):
    with pytest.raises(ImportError) as info:
        cutile_internals.check_version(version)
    message = str(info.value)
    assert f"cuda-tile {version} is installed" in message
    assert ">=1.7,<1.8" in message and "pip install 'cuda-tile>=1.7,<1.8'" in message


def test_kernel_function_and_hints():
    assert cutile_internals.kernel_function(ek.vector_add).__name__ == "vector_add"
    hinted = ct.kernel(cutile_internals.kernel_function(ek.vector_add), occupancy=2)
    assert cutile_internals.kernel_hints(hinted) == {"occupancy": 2, "opt_level": 3}
    with pytest.raises(TypeError, match="expected a @ct.kernel"):
        cutile_internals.kernel_function(cutile_internals.kernel_function(ek.vector_add))


def test_every_emulation_is_named_after_a_real_stub():
    for name in OPS:
        obj = stub_module
        for part in name.split("."):
            obj = getattr(obj, part)
        assert callable(obj), name


def test_the_gpu_path_imports_no_private_module_by_name():
    """Launching on a GPU needs kernel_function / kernel_hints only; what the interpreter needs
    from cuda.tile's private modules is imported when the interpreter first asks for it."""
    import subprocess
    import sys
    code = ("import ops.runtime.launch, ops.runtime.cutile_internals as ci; "
            "print(sorted(n for n in ci._LAZY if n in vars(ci)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert cutile_internals.DispatchMode.__name__ == "DispatchMode"
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        cutile_internals.no_such_name
