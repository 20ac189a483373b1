"""The CUDA source in minivit/kernels.py, checked without a GPU.

On a GPU, CuPy compiles ``kernels._ROW_SOURCE`` (with NVRTC) the first time a row kernel is launched, so
a typo in it would first show on a GPU machine, which CI does not have. Here nvcc, the CUDA compiler,
compiles the same text for float and for double (skipped where nvcc is not installed), and the Python
glue is read for the kernels it launches: each must be defined in the source, with as many parameters
as the glue passes arguments.
"""

import ast
import inspect
import os
import re
import shutil
import subprocess

import pytest

from minivit import kernels


def _nvcc():
    found = shutil.which("nvcc")
    if found is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        found = "/usr/local/cuda/bin/nvcc"
    return found


NVCC = _nvcc()


def defined_kernels():
    """{name: number of parameters} of every ``extern "C" __global__ void name(...)`` in _ROW_SOURCE."""
    found = re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', kernels._ROW_SOURCE)
    return {name: len([p for p in params.split(",") if p.strip()]) for name, params in found}


def launched_kernels():
    """[(name, number of arguments)] of every ``_launch_rows("name", rows, length, dtype, (args...))``."""
    tree = ast.parse(inspect.getsource(kernels))
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_launch_rows":
            name, args = node.args[0], node.args[4]
            assert isinstance(name, ast.Constant) and isinstance(args, ast.Tuple), ast.unparse(node)
            calls.append((name.value, len(args.elts)))
    return calls


def test_every_kernel_the_glue_launches_is_in_the_source_with_its_arguments():
    defined = defined_kernels()
    launched = launched_kernels()
    assert {"layernorm_fwd", "layernorm_bwd", "softmax_fwd", "softmax_bwd",
            "softmax_lse_fwd", "softmax_lse_bwd"} <= {name for name, _ in launched}
    for name, n_args in launched:
        assert name in defined, f"the glue launches {name}, which _ROW_SOURCE does not define"
        assert n_args == defined[name], f"{name} takes {defined[name]} parameters, the glue passes {n_args}"


@pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA compiler) is not installed")
@pytest.mark.parametrize("T", ["float", "double"])
def test_row_kernels_compile_with_nvcc(tmp_path, T):
    """Every row kernel compiles for sm_90 (a few seconds); any error fails the test, with nvcc's message."""
    source = tmp_path / f"rows_{T}.cu"
    source.write_text(kernels._ROW_SOURCE % {"T": T})
    cubin = tmp_path / f"rows_{T}.cubin"
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-o", str(cubin), str(source)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"nvcc failed on _ROW_SOURCE with T={T}:\n{done.stderr}"
    assert cubin.stat().st_size > 0
