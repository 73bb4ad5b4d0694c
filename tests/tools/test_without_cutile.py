"""Where cuda-tile cannot be installed (it has no wheels for macOS or Arm Linux), notebooks 01 and
02 still run: they need PyTorch, matplotlib and the ``reference`` package only, and ``import ops``
works without cuda-tile. ``notebooks/INSTRUCTORS.md`` tells learners on such laptops so; this
checks it, with every ``cuda`` module made unimportable in the processes it starts.
"""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCKER = '''
import sys
class _NoCudaTile:
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError(f"{name}: not installed on this machine (blocked by the test)")
sys.meta_path.insert(0, _NoCudaTile())
'''


def _env(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("MPLBACKEND", None)     # the notebooks' figures are outputs nbval compares
    return env


def test_the_blocker_blocks(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import cuda.tile"], env=_env(tmp_path),
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and "not installed on this machine" in proc.stderr


def test_import_ops_and_the_reference_without_cutile(tmp_path):
    code = ("import ops, reference.chunked, reference.sequential\n"
            "from ops import mamba_chunk_scan_combined\n"
            "import torch\n"
            "x = torch.randn(1, 64, 2, 8); dt = torch.rand(1, 64, 2); A = -torch.rand(2)\n"
            "B, C = torch.randn(1, 64, 1, 16), torch.randn(1, 64, 1, 16)\n"
            "out = mamba_chunk_scan_combined(x, dt, A, B, C, 32)\n"
            "ref = reference.sequential.ssd_sequential(x, dt, A, B, C)\n"
            "torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)\n"
            "print('reference backend without cuda-tile: ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout


def test_notebooks_01_and_02_run_without_cutile(tmp_path):
    notebooks = [str(ROOT / "notebooks" / name) for name in
                 ("01_sequential_recurrence.ipynb", "02_chunked_matmul.ipynb")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--nbval", *notebooks], env=_env(tmp_path), capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
