"""The CUDA source in minivit/fast/cuda.py, compiled and checked without a GPU.

On a GPU, CuPy compiles each kernel with NVRTC the first time it is launched, so a typo in the CUDA text
would first show on a GPU machine, which CI does not have. NVRTC itself needs no GPU: the PyPI wheel
nvidia-cuda-nvrtc-cu12 (requirements.txt) holds the library, and here it compiles, with the options CuPy
passes (-ftz=true, the C++ standard, an architecture; CuPy 14 on an H200 uses compute_90):
- ``cuda._ROW_SOURCE`` (the RawModule of the row kernels), for float and for double;
- every ElementwiseKernel body cuda.py defines, inside a kernel declared as CuPy declares one (each
  input parameter a ``const`` value, each output a reference, ``i`` the index), for float and double.
The Python glue is read too: each row kernel it launches must be defined in the source and be given
arguments of the right kinds (a device array for a pointer, numpy.int32 for an int, a scalar of the array's
dtype for T), in the right number. (tests/test_gpu_glue.py checks the same at run time, under a stand-in.)
Skipped, saying so, when the NVRTC library cannot be found.
"""

import ast
import ctypes
import glob
import inspect
import os
import re

import pytest

from minivit.fast import cuda

NVRTC_OPTIONS = ("-arch=compute_90", "-ftz=true", "--std=c++17")   # what CuPy adds for an H200 (sm_90)


def _find_nvrtc():
    """The NVRTC library: from the nvidia-cuda-nvrtc-cu12 wheel, else a system CUDA's; None if neither."""
    candidates = []
    try:
        import nvidia.cuda_nvrtc
        for folder in nvidia.cuda_nvrtc.__path__:
            candidates += sorted(glob.glob(os.path.join(folder, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    candidates += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))
    for path in candidates:
        if "builtins" in path or ".alt." in path:
            continue
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


NVRTC = _find_nvrtc()
needs_nvrtc = pytest.mark.skipif(NVRTC is None, reason="the NVRTC library is not installed "
                                                       "(pip install nvidia-cuda-nvrtc-cu12)")


def nvrtc_compile(source, name="minivit.cu", options=NVRTC_OPTIONS):
    """(ok, log): source compiled to PTX by NVRTC with the given options."""
    prog = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) == 0
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        result = NVRTC.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(prog, log)
        ptx_size = ctypes.c_size_t()
        if result == 0:
            NVRTC.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size))
        return result == 0 and ptx_size.value > 0, log.value.decode(errors="replace")
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))


# ---- what cuda.py defines and launches -----------------------------------------------------------

def defined_kernels():
    """{name: [parameter type, ...]} of every ``extern "C" __global__ void name(...)`` in _ROW_SOURCE."""
    found = re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', cuda._ROW_SOURCE)
    return {name: [" ".join(p.split()[:-1]) for p in params.split(",") if p.strip()] for name, params in found}


def _kind(node):
    """What a launch argument is, read from the glue's source: 'int' (numpy.int32(...)), 'T' (a scalar made
    by <array>.dtype.type(...)), else 'pointer' (an array)."""
    if isinstance(node, ast.Call):
        if ast.unparse(node.func) == "numpy.int32":
            return "int"
        if ast.unparse(node.func).endswith(".dtype.type"):
            return "T"
    if isinstance(node, ast.Constant):
        return "a Python constant"          # CuPy would pass it as a 64-bit int or a double: wrong
    return "pointer"


def _expected(param_type):
    return "pointer" if param_type.endswith("*") else param_type


def launched_kernels():
    """[(name, [argument kinds])] of every ``_launch_rows("name", rows, length, dtype, (args...))``."""
    tree = ast.parse(inspect.getsource(cuda))
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_launch_rows":
            name, args = node.args[0], node.args[4]
            assert isinstance(name, ast.Constant) and isinstance(args, ast.Tuple), ast.unparse(node)
            calls.append((name.value, [_kind(a) for a in args.elts]))
    return calls


def test_every_kernel_the_glue_launches_is_in_the_source_with_arguments_of_the_right_kinds():
    defined = defined_kernels()
    launched = launched_kernels()
    assert {"layernorm_fwd", "layernorm_bwd", "softmax_fwd", "softmax_bwd",
            "softmax_lse_fwd", "softmax_lse_bwd"} <= {name for name, _ in launched}
    for name, kinds in launched:
        assert name in defined, f"the glue launches {name}, which _ROW_SOURCE does not define"
        expected = [_expected(t) for t in defined[name]]
        assert kinds == expected, f"{name} takes {defined[name]}; the glue passes {kinds}"


def test_the_launch_check_catches_a_wrong_argument_kind():
    """The check above can fail: a Python float where the kernel takes T, an int where it takes a pointer."""
    tree = ast.parse('_launch_rows("softmax_fwd", 1, 1, d, (x2, y, 5))\n_launch_rows("softmax_fwd", 1, 1, d, '
                     '(x2, y, numpy.int32(n)))')
    kinds = [[_kind(a) for a in call.args[4].elts] for call in (stmt.value for stmt in tree.body)]
    expected = [_expected(t) for t in defined_kernels()["softmax_fwd"]]
    assert kinds[0] != expected and kinds[1] == expected


def elementwise_kernels():
    """[(name, in_params, out_params, body)] of every _elementwise(...) call in cuda.py: a name that is a
    local variable of the calling function is read from its assignment there, both branches of a body
    chosen by `a if cond else b` are taken, and a name made by an f-string is kept as written."""
    tree = ast.parse(inspect.getsource(cuda))
    found = []

    def values(node, local):
        if isinstance(node, ast.IfExp):
            return values(node.body, local) + values(node.orelse, local)
        if isinstance(node, ast.Constant):
            return [node.value]
        if isinstance(node, ast.Name):
            return values(local[node.id], local) if node.id in local else [getattr(cuda, node.id)]
        if isinstance(node, ast.JoinedStr):        # f"minivit_gelu_{approximate}_fwd"
            return [ast.unparse(node)]
        raise AssertionError(f"cannot read {ast.unparse(node)}")

    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        local = {t.id: a.value for a in ast.walk(function) if isinstance(a, ast.Assign)
                 for t in a.targets if isinstance(t, ast.Name)}
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_elementwise":
                name, in_params, out_params, body = node.args
                for i, text in enumerate(values(body, local)):
                    found.append((f"{values(name, local)[0]}_{i}", values(in_params, local)[0],
                                  values(out_params, local)[0], text))
    return found


_C_TYPE = {"bool": "bool", "uint64": "unsigned long long", "int32": "int", "float32": "float", "float64": "double"}


def as_cupy_declares_it(index, in_params, out_params, body):
    """An ElementwiseKernel's body inside a kernel of our own, its parameters declared as CuPy declares them."""
    def split(spec):
        return [p.split() for p in spec.split(",") if p.strip()]

    def ctype(t):
        return "T" if t == "T" else _C_TYPE[t]

    args = [f"const {ctype(t)}* _in_{n}" for t, n in split(in_params)]
    args += [f"{ctype(t)}* _out_{n}" for t, n in split(out_params)]
    inputs = "\n".join(f"        const {ctype(t)} {n} = _in_{n}[i];" for t, n in split(in_params))
    outputs = "\n".join(f"        {ctype(t)}& {n} = _out_{n}[i];" for t, n in split(out_params))
    return (f'extern "C" __global__ void elementwise_{index}({", ".join(args)}, long long n) {{\n'
            f"    for (ptrdiff_t i = blockIdx.x * (ptrdiff_t)blockDim.x + threadIdx.x; i < n;"
            f" i += (ptrdiff_t)blockDim.x * gridDim.x) {{\n{inputs}\n{outputs}\n{body}\n    }}\n}}\n")


def test_every_elementwise_kernel_is_found():
    names = {name.rsplit("_", 1)[0] for name, *_ in elementwise_kernels()}
    assert {"minivit_adamw", "minivit_sgd", "minivit_sgd_momentum", "minivit_keep_mask"} <= names
    bodies = {body for *_, body in elementwise_kernels()}
    assert {cuda._GELU_ERF_FWD, cuda._GELU_ERF_BWD, cuda._GELU_TANH_FWD, cuda._GELU_TANH_BWD,
            cuda._ADAMW_BODY, cuda._SGD_BODY, cuda._SGD_MOMENTUM_BODY, cuda._KEEP_MASK_BODY} <= bodies


@needs_nvrtc
@pytest.mark.parametrize("T", ["float", "double"])
def test_row_kernels_compile_with_nvrtc(T):
    ok, log = nvrtc_compile(cuda._ROW_SOURCE % {"T": T}, "rows.cu")
    assert ok, f"NVRTC failed on _ROW_SOURCE with T={T}:\n{log}"


@needs_nvrtc
@pytest.mark.parametrize("T", ["float", "double"])
def test_every_elementwise_body_compiles_with_nvrtc(T):
    source = f"typedef {T} T;\n" + "\n".join(as_cupy_declares_it(i, *k[1:])
                                              for i, k in enumerate(elementwise_kernels()))
    ok, log = nvrtc_compile(source, "elementwise.cu")
    assert ok, f"NVRTC failed on the ElementwiseKernel bodies with T={T}:\n{log}\n{source}"


@needs_nvrtc
def test_nvrtc_really_rejects_a_typo():
    """The compile tests can fail: a body with an undeclared name and a row source with a missing brace."""
    ok, log = nvrtc_compile("typedef float T;\n" + as_cupy_declares_it(0, "T x", "T y", "y = x * undeclared;"))
    assert not ok and "undeclared" in log
    source, line = cuda._ROW_SOURCE % {"T": "float"}, "T m_raw = s[base];"
    assert line in source                                   # (else the brace below would go nowhere)
    ok, _ = nvrtc_compile(source.replace(line, line + "{", 1))
    assert not ok
