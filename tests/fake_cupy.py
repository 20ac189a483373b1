"""A strict stand-in for CuPy, for CPU tests of minivit's GPU *glue* only. It proves nothing about GPU numbers
or GPU speed: it computes with NumPy underneath.

What it is for: no GPU exists on the development machines or in CI, so the Python that drives CuPy
(minivit/fast's launches, the optimizer, the trainer's step) would otherwise run for the first time on a GPU.
Under this stand-in the real code paths run, and:
- a device array refuses what CuPy refuses: implicit conversion to NumPy (``numpy.asarray(x)``), and mixing
  with host arrays in an operation (``device + host``); so host/device mixing fails here as it would there;
- every operation that would be a kernel launch on a GPU is counted (``COUNTS.launches``), by name: a ufunc,
  a reduction, a copy, an ElementwiseKernel, a RawKernel, a cuBLAS call; views (reshape of a contiguous
  array, transpose, slicing) are free, as on a GPU;
- every point where the host waits for the device is counted (``COUNTS.syncs``): ``float(x)``, ``int(x)``,
  ``bool(x)``, ``x.item()``, ``cupy.asnumpy``, ``x.get()``, a stream synchronize; and host-to-device copies
  (``COUNTS.h2d``).
How kernels are emulated: an ElementwiseKernel's C body is translated line by line into NumPy (the body
really runs, in the dtype of T); a RawKernel launch is checked against its CUDA signature (each argument's
kind and dtype) and then computed by a NumPy version of the same kernel, by name (ROW_KERNELS below); the
one cuBLAS call minivit makes (gemmStridedBatchedEx) reads and writes through the raw pointers it is given,
column-major, as cuBLAS does, after checking that every byte it touches lies inside a live allocation.

Use: ``with fake_cupy.installed(): ...`` (tests/test_gpu_glue.py); minivit then sees a "GPU".
"""

import contextlib
import ctypes
import re
import sys
import types
import weakref

import numpy
import scipy.special

__version__ = "0.0-fake"


class Counters:
    def __init__(self):
        self.reset()

    def reset(self):
        self.launches = []       # names, in order
        self.syncs = []          # what waited
        self.h2d = 0             # host-to-device copies
        self.compute_types = []  # cuBLAS compute type of each gemm

    def launch(self, name):
        self.launches.append(name)

    def sync(self, why):
        self.syncs.append(why)


COUNTS = Counters()
_live = weakref.WeakValueDictionary()     # id -> base numpy buffer of every device allocation still alive


def _alloc(a):
    """A new device allocation holding numpy array a."""
    return ndarray(a)


class _Flags:
    def __init__(self, a):
        self.c_contiguous, self.f_contiguous = a.flags.c_contiguous, a.flags.f_contiguous

    def __getitem__(self, key):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous}[key]


class _Memory:
    def __init__(self, ptr):
        self.ptr = ptr


def _refuse_host(values, what):
    for v in values:
        if isinstance(v, numpy.ndarray):
            raise TypeError(f"fake CuPy: {what} mixes a device array with a host numpy.ndarray {v.shape} "
                            "(real CuPy raises TypeError: Unsupported type <class 'numpy.ndarray'>)")


def _unwrap(v):
    if isinstance(v, ndarray):
        return v._a
    if isinstance(v, (list, tuple)):
        return type(v)(_unwrap(x) for x in v)
    return v


def _wrap(v):
    if isinstance(v, numpy.ndarray):
        return ndarray(v)
    if isinstance(v, numpy.generic):        # CuPy returns 0-d arrays, never host scalars
        return ndarray(numpy.asarray(v))
    if isinstance(v, tuple):
        return tuple(_wrap(x) for x in v)
    return v


def _flat_args(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat_args(a)
        else:
            yield a


def _compute(name, fn, args, kwargs):
    _refuse_host(list(_flat_args(args)) + list(_flat_args(kwargs.values())), name)
    COUNTS.launch(name)
    out = kwargs.get("out")
    result = fn(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
    return out if isinstance(out, ndarray) else _wrap(result)


class ndarray:
    """A device array: a NumPy array inside that the host may not touch without a counted transfer."""

    __module__ = "cupy"           # as type(x).__module__ of a real CuPy array (minivit/fast/cuda.py asks it)

    __array_ufunc__ = None        # NumPy never computes with one (host + device -> our __radd__ -> TypeError)
    __array_priority__ = 1000

    def __init__(self, a):
        if not isinstance(a, numpy.ndarray):
            raise TypeError(f"fake ndarray wraps a numpy array, got {type(a)}")
        self._a = a
        owner = a
        while isinstance(owner.base, numpy.ndarray):
            owner = owner.base
        _live[id(owner)] = owner              # the allocation this array lives in

    # ---- what CuPy refuses ----
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
                        "a NumPy array explicitly. (fake CuPy)")

    # ---- host reads: each one waits for the device ----
    def _read(self, why):
        COUNTS.sync(why)
        return self._a

    def __float__(self):
        return float(self._read("float()"))

    def __int__(self):
        return int(self._read("int()"))

    def __index__(self):
        return int(self._read("index"))

    def __bool__(self):
        return bool(self._read("bool()"))

    def item(self):
        return self._read("item()").item()

    def tolist(self):
        return self._read("tolist()").tolist()

    def get(self):
        return self._read("get()").copy()

    # ---- attributes ----
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _Memory(self._a.ctypes.data))
    T = property(lambda self: ndarray(self._a.T))
    base = property(lambda self: None)

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"fake_cupy.ndarray(shape={self.shape}, dtype={self.dtype})"

    # ---- views: no launch ----
    def reshape(self, *shape, **kw):
        out = self._a.reshape(*shape, **kw)
        if not numpy.shares_memory(out, self._a) and out.size:
            COUNTS.launch("copy(reshape)")
        return ndarray(out)

    def ravel(self):
        return self.reshape(-1)

    def transpose(self, *axes):
        return ndarray(self._a.transpose(*axes))

    def swapaxes(self, a, b):
        return ndarray(self._a.swapaxes(a, b))

    def view(self, *a):
        return ndarray(self._a.view(*a))

    def squeeze(self, *a, **k):
        return ndarray(self._a.squeeze(*a, **k))

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        _refuse_host(index, "indexing")
        advanced = any(isinstance(i, ndarray) or isinstance(i, list) for i in index)
        if advanced:
            COUNTS.launch("take(index)")
        if advanced:
            return _wrap(self._a[_unwrap(index)])
        if Ellipsis not in index:
            index = index + (Ellipsis,)          # an integer index gives a 0-d view, as in CuPy
        return ndarray(self._a[index])

    def __setitem__(self, index, value):
        index = index if isinstance(index, tuple) else (index,)
        _refuse_host(index, "indexing")
        if isinstance(value, numpy.ndarray):       # CuPy copies a host value to the device first
            COUNTS.h2d += 1
        COUNTS.launch("setitem")
        self._a[_unwrap(index)] = _unwrap(value)

    # ---- everything else: one launch each ----
    def copy(self, order="C"):
        COUNTS.launch("copy")
        return _alloc(self._a.copy(order=order))

    def astype(self, dtype, copy=True, **kw):
        if not copy and numpy.dtype(dtype) == self.dtype:
            return self
        COUNTS.launch("astype")
        return _alloc(self._a.astype(dtype, **kw))

    def fill(self, value):
        COUNTS.launch("fill")
        self._a.fill(value)

    def __getattr__(self, name):               # sum, mean, max, min, argmax, var, all, any, dot, clip, ...
        if name.startswith("__"):              # never __array_interface__ & co.: NumPy would read the memory
            raise AttributeError(name)
        fn = getattr(self._a, name)
        if not callable(fn):
            return _wrap(fn)

        def method(*args, **kwargs):
            return _compute(f"ndarray.{name}", fn, args, kwargs)
        return method


def _binary(name, op, swap=False, inplace=False):
    def f(self, other):
        _refuse_host([other], f"operator {name}")
        COUNTS.launch(f"ufunc:{name}")
        a, b = (_unwrap(other), self._a) if swap else (self._a, _unwrap(other))
        if inplace:
            op(a, b, out=self._a, casting="same_kind")
            return self
        return _wrap(op(a, b))
    return f


for _name, _op in [("add", numpy.add), ("subtract", numpy.subtract), ("multiply", numpy.multiply),
                   ("true_divide", numpy.true_divide), ("floor_divide", numpy.floor_divide),
                   ("power", numpy.power), ("matmul", numpy.matmul), ("mod", numpy.mod), ("and", numpy.bitwise_and),
                   ("or", numpy.bitwise_or), ("xor", numpy.bitwise_xor)]:
    short = {"subtract": "sub", "multiply": "mul", "true_divide": "truediv", "floor_divide": "floordiv",
             "power": "pow"}.get(_name, _name)
    setattr(ndarray, f"__{short}__", _binary(_name, _op))
    setattr(ndarray, f"__r{short}__", _binary(_name, _op, swap=True))
    setattr(ndarray, f"__i{short}__", _binary(_name, _op, inplace=True))
for _name, _op in [("lt", numpy.less), ("le", numpy.less_equal), ("gt", numpy.greater), ("ge", numpy.greater_equal),
                   ("eq", numpy.equal), ("ne", numpy.not_equal)]:
    setattr(ndarray, f"__{_name}__", _binary(_name, _op))
ndarray.__neg__ = lambda self: _compute("ufunc:negative", numpy.negative, (self,), {})
ndarray.__abs__ = lambda self: _compute("ufunc:absolute", numpy.absolute, (self,), {})
ndarray.__invert__ = lambda self: _compute("ufunc:invert", numpy.invert, (self,), {})
ndarray.__hash__ = None


# --------------------------------------------------------------------------------------------------
# the module's functions
# --------------------------------------------------------------------------------------------------

def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):
        return a if dtype is None or numpy.dtype(dtype) == a.dtype else a.astype(dtype)
    host = numpy.asarray(a, dtype=dtype)
    COUNTS.h2d += 1
    return _alloc(numpy.array(host, order="C"))


array = asarray


def asnumpy(a):
    return a.get() if isinstance(a, ndarray) else numpy.asarray(a)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        _refuse_host([a], "ascontiguousarray")
    if a.flags.c_contiguous and (dtype is None or numpy.dtype(dtype) == a.dtype):
        return a
    COUNTS.launch("copy(ascontiguousarray)")
    return _alloc(numpy.ascontiguousarray(a._a, dtype=dtype))


def get_array_module(*arrays):
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in arrays) else numpy


def _creation(name, launches):
    fn = getattr(numpy, name)

    def create(*args, **kwargs):
        _refuse_host(list(_flat_args(args)), name)
        if launches:
            COUNTS.launch(name)
        return _alloc(numpy.asarray(fn(*_unwrap(args), **kwargs)))
    return create


empty, empty_like = _creation("empty", False), _creation("empty_like", False)
zeros, zeros_like, ones, ones_like, full, full_like, arange, eye = (
    _creation(n, True) for n in ("zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "arange", "eye"))

_VIEWS = {"broadcast_to", "expand_dims", "swapaxes", "transpose", "squeeze", "reshape", "moveaxis"}


def __getattr__(name):                       # exp, log, sqrt, matmul, stack, concatenate, where, isfinite, ...
    obj = getattr(numpy, name)
    if isinstance(obj, type) or not callable(obj):
        return obj                           # dtypes (cupy.float32 is numpy.float32), constants

    def fn(*args, **kwargs):
        if name in _VIEWS:
            _refuse_host(list(_flat_args(args)), name)
            return _wrap(obj(*_unwrap(args), **kwargs))
        return _compute(name, obj, args, kwargs)
    return fn


class _Linalg(types.ModuleType):
    def __getattr__(self, name):
        fn = getattr(numpy.linalg, name)
        return lambda *a, **k: _compute(f"linalg.{name}", fn, a, k)


linalg = _Linalg("cupy.linalg")


def _scipy_erf(x):
    return _compute("erf", lambda v: scipy.special.erf(v).astype(v.dtype, copy=False), (x,), {})


# --------------------------------------------------------------------------------------------------
# ElementwiseKernel and ReductionKernel: the C body translated to NumPy
# --------------------------------------------------------------------------------------------------

_C_TYPES = r"(?:const\s+)?(?:T|float|double|int|bool|long long|unsigned long long|unsigned int)"


def translate(body):
    """A CuPy ElementwiseKernel body as Python lines over NumPy arrays. Supported C: declarations
    (``T t = ...;``), assignments (``=``, ``+=``, ``-=``, ``*=``), casts ``(T)x``, ``(unsigned long long)x``,
    the math functions, ``<<``, ``>>``, ``^``, ``&``; no branches, no loops (minivit's bodies have none)."""
    lines = []
    body = re.sub(r"//[^\n]*", "", body)                                         # comments
    for statement in body.split(";"):
        s = " ".join(statement.split())
        if not s or s.startswith("//"):
            continue
        s = re.sub(rf"^{_C_TYPES}\s+(\w+)\s*=", r"\1 =", s)                    # T t = ... -> t = ...
        s = re.sub(r"\((unsigned long long|long long|unsigned int|float|double|T|int)\)\s*"
                   r"(\w+(?:\.\w+)?(?:[eE][-+]?\d+)?|\([^()]*\))",
                   lambda m: f"_cast_{m.group(1).replace(' ', '_')}({m.group(2)})", s)  # (T)x -> _cast_T(x)
        s = re.sub(r"\b(0x[0-9A-Fa-f]+|\d+)ULL\b", r"_u64(\1)", s)
        ternary = re.match(r"^(\w+ =) ([^?]+)\?([^:]+):(.+)$", s)       # x = c ? a : b  (one, not nested)
        if ternary:
            s = f"{ternary.group(1)} _where({ternary.group(2)}, {ternary.group(3)}, {ternary.group(4)})"
        if "?" in s or re.match(r"^(if|for|while)\b", s):
            raise ValueError(f"fake CuPy cannot translate {statement!r}")
        lines.append(s)
    return "\n".join(lines)


def _namespace(T):
    u64 = numpy.uint64
    ns = {"erf": lambda v: scipy.special.erf(v).astype(numpy.asarray(v).dtype, copy=False),
          "exp": numpy.exp, "log": numpy.log, "sqrt": numpy.sqrt, "tanh": numpy.tanh, "abs": numpy.abs,
          "max": numpy.maximum, "min": numpy.minimum, "fmax": numpy.fmax, "fmin": numpy.fmin,
          "_cast_T": lambda v: numpy.asarray(v, T) if numpy.ndim(v) else T(v),
          "_cast_float": lambda v: numpy.asarray(v, numpy.float32),
          "_cast_double": lambda v: numpy.asarray(v, numpy.float64),
          "_cast_int": lambda v: numpy.asarray(v).astype(numpy.int32),
          "_cast_unsigned_long_long": lambda v: numpy.asarray(v).astype(u64),
          "_cast_long_long": lambda v: numpy.asarray(v).astype(numpy.int64),
          "_cast_unsigned_int": lambda v: numpy.asarray(v).astype(numpy.uint32),
          "_u64": u64, "_where": numpy.where}
    return ns


def _params(spec):
    """'T x, float32 lr, raw T y' -> [(type, name, raw)]."""
    out = []
    for p in spec.split(","):
        words = p.split()
        if not words:
            continue
        raw = words[0] == "raw"
        words = words[1:] if raw else words
        out.append((words[0], words[1], raw))
    return out


class ElementwiseKernel:
    def __init__(self, in_params, out_params, operation, name="kernel", **kwargs):
        self.in_params, self.out_params = _params(in_params), _params(out_params)
        self.operation, self.name = operation, name
        self.code = compile(translate(operation), f"<ElementwiseKernel {name}>", "exec")

    def __call__(self, *args, size=None):
        n_in, n_out = len(self.in_params), len(self.out_params)
        if len(args) not in (n_in, n_in + n_out):
            raise TypeError(f"{self.name}: {len(args)} arguments, expected {n_in} or {n_in + n_out}")
        _refuse_host(args, f"ElementwiseKernel {self.name}")
        ins, outs = args[:n_in], list(args[n_in:])
        T = None
        for (typ, _, _), a in zip(self.in_params + self.out_params, args):
            if typ == "T" and isinstance(a, ndarray):
                T = a.dtype.type
                break
        arrays = [a._a for a in args if isinstance(a, ndarray)]
        shape = numpy.broadcast_shapes(*(a.shape for a in arrays)) if arrays else ()
        if not outs:
            outs = [_alloc(numpy.empty(shape, T if typ == "T" else numpy.dtype(typ))) for typ, _, _ in self.out_params]
        for (typ, name, _), a in zip(self.in_params + self.out_params, list(ins) + outs):
            if isinstance(a, ndarray) and typ == "T" and a.dtype.type is not T:
                raise TypeError(f"{self.name}: {name} is {a.dtype}, T is {numpy.dtype(T)}")
        ns = _namespace(T)
        for (typ, name, _), a in zip(self.in_params, ins):
            if isinstance(a, ndarray):
                ns[name] = numpy.broadcast_to(a._a, shape).copy()
            else:
                ns[name] = (T if typ == "T" else numpy.dtype(typ).type)(a)     # a scalar argument, cast as CuPy does
        for (typ, name, _), a in zip(self.out_params, outs):
            ns[name] = a._a.copy()
        ns["i"] = numpy.arange(int(numpy.prod(shape)), dtype=numpy.int64).reshape(shape)
        COUNTS.launch(f"ElementwiseKernel:{self.name}")
        with numpy.errstate(over="ignore"):
            exec(self.code, ns)
        for (typ, name, _), a in zip(self.out_params, outs):
            a._a[...] = ns[name]
        return outs[0] if len(outs) == 1 else tuple(outs)


class ReductionKernel:
    def __init__(self, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, name="reduce", **kw):
        if reduce_expr.replace(" ", "") != "a+b" or post_map_expr.replace(" ", "") != "y=a":
            raise ValueError("fake CuPy emulates sum reductions only")
        self.in_params, self.map_expr, self.name = _params(in_params), map_expr, name

    def __call__(self, *args, axis=None):
        _refuse_host(args, f"ReductionKernel {self.name}")
        ns = _namespace(args[0].dtype.type)
        ns.update({name: a._a for (_, name, _), a in zip(self.in_params, args)})
        COUNTS.launch(f"ReductionKernel:{self.name}")
        return _alloc(numpy.asarray(eval(self.map_expr, ns).sum(axis=axis), dtype=args[0].dtype))


# --------------------------------------------------------------------------------------------------
# RawModule: each launch checked against its CUDA signature, then computed by name
# --------------------------------------------------------------------------------------------------

def signatures(source):
    """{kernel name: [parameter type, ...]} of every ``extern "C" __global__ void`` in a CUDA source."""
    found = re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', source)
    return {name: [" ".join(p.split()[:-1]) for p in params.split(",") if p.strip()] for name, params in found}


def check_arguments(name, param_types, args, T):
    """Each argument as the CUDA parameter wants it: a pointer takes a contiguous device array of T, an
    ``int`` a numpy.int32, a ``T`` a numpy scalar of T. (CuPy passes a Python int as a 64-bit integer and a
    float as a double: the kernel would read garbage; so those are refused here.)"""
    if len(args) != len(param_types):
        raise TypeError(f"{name} takes {len(param_types)} arguments, got {len(args)}")
    for i, (typ, a) in enumerate(zip(param_types, args)):
        where = f"{name} argument {i} ({typ})"
        if typ.endswith("*"):
            if not isinstance(a, ndarray) or not a.flags.c_contiguous:
                raise TypeError(f"{where}: needs a C-contiguous device array, got {a!r}")
            if a.dtype.type is not T:
                raise TypeError(f"{where}: needs {numpy.dtype(T)}, got {a.dtype}")
        elif typ == "int":
            if type(a) is not numpy.int32:
                raise TypeError(f"{where}: needs numpy.int32, got {type(a).__name__}")
        elif typ == "T":
            if type(a) is not T:
                raise TypeError(f"{where}: needs {numpy.dtype(T)}, got {type(a).__name__}")
        else:
            raise TypeError(f"{where}: the fake does not know this parameter type")


def _rows(a, n):
    return a._a.reshape(-1, n)


def _ln_fwd(x, w, b, y, xhat, rstd, D, eps):
    x2 = _rows(x, D)
    mean = x2.mean(-1, keepdims=True)
    r = 1 / numpy.sqrt(((x2 - mean) ** 2).mean(-1, keepdims=True) + eps)
    _rows(xhat, D)[...] = (x2 - mean) * r
    _rows(y, D)[...] = _rows(xhat, D) * w._a + b._a
    rstd._a[...] = r.reshape(-1)


def _ln_bwd(dout, xhat, rstd, w, dx, D):
    g = _rows(dout, D) * w._a
    h = _rows(xhat, D)
    _rows(dx, D)[...] = rstd._a[:, None] * (g - g.mean(-1, keepdims=True) - h * (g * h).mean(-1, keepdims=True))


def _sm_fwd(x, y, n):
    x2 = _rows(x, n)
    e = numpy.exp(x2 - x2.max(-1, keepdims=True))
    _rows(y, n)[...] = e / e.sum(-1, keepdims=True)


def _sm_bwd(dout, s, dx, n):
    d2, s2 = _rows(dout, n), _rows(s, n)
    _rows(dx, n)[...] = s2 * (d2 - (d2 * s2).sum(-1, keepdims=True))


def _lse_weights(s, n, scale):
    raw = _rows(s, n)
    m = raw.max(-1, keepdims=True)
    e = numpy.exp((raw - m) * scale)
    total = e.sum(-1, keepdims=True)
    return e / total, m * scale + numpy.log(total)


def _lse_fwd(s, lse, n, scale):
    p, lse_rows = _lse_weights(s, n, scale)
    _rows(s, n)[...] = p
    lse._a[...] = lse_rows.reshape(-1)


def _lse_bwd(s, dp, n, scale):
    p, _ = _lse_weights(s, n, scale)
    _rows(s, n)[...] = p
    d = _rows(dp, n)
    d[...] = p * (d - (p * d).sum(-1, keepdims=True)) * scale


ROW_KERNELS = {"layernorm_fwd": _ln_fwd, "layernorm_bwd": _ln_bwd, "softmax_fwd": _sm_fwd, "softmax_bwd": _sm_bwd,
               "softmax_lse_fwd": _lse_fwd, "softmax_lse_bwd": _lse_bwd}


class _RawFunction:
    def __init__(self, module, name):
        self.module, self.name = module, name

    def __call__(self, grid, block, args, shared_mem=0):
        T = numpy.float64 if self.module.code.lstrip().startswith("typedef double") else numpy.float32
        check_arguments(self.name, self.module.signatures[self.name], args, T)
        if shared_mem < block[0] * numpy.dtype(T).itemsize:
            raise ValueError(f"{self.name}: {shared_mem} bytes of shared memory for {block[0]} threads")
        COUNTS.launch(f"RawKernel:{self.name}")
        ROW_KERNELS[self.name](*args)


class RawModule:
    def __init__(self, code, options=(), **kw):
        self.code = code
        self.signatures = signatures(code)
        self.get_function_calls = 0

    def get_function(self, name):
        self.get_function_calls += 1
        if name not in self.signatures:
            raise KeyError(f"{name} is not defined in the module")
        return _RawFunction(self, name)


# --------------------------------------------------------------------------------------------------
# cupy.cuda: the device, the stream, cuBLAS's one call
# --------------------------------------------------------------------------------------------------

def _host_view(ptr, dtype, count):
    """count values of dtype at device address ptr, after checking they lie inside one live allocation."""
    nbytes = count * numpy.dtype(dtype).itemsize
    for base in list(_live.values()):
        start = base.ctypes.data
        if start <= ptr and ptr + nbytes <= start + base.nbytes:
            buf = (ctypes.c_char * nbytes).from_address(ptr)
            return numpy.frombuffer(buf, dtype=dtype, count=count)
    raise ValueError(f"fake cuBLAS: {nbytes} bytes at {ptr:#x} are outside every device allocation")


def _col_major(ptr, dtype, trans, rows, cols, ld, stride, batch):
    """The batch of op(X), each (rows, cols), of a column-major X at ptr (X is (cols, rows) when trans)."""
    r, c = (cols, rows) if trans else (rows, cols)
    if ld < r:
        raise ValueError(f"fake cuBLAS: leading dimension {ld} < {r} rows")
    extent = (batch - 1) * stride + (c - 1) * ld + r
    it = numpy.dtype(dtype).itemsize
    x = numpy.lib.stride_tricks.as_strided(_host_view(ptr, dtype, extent), (batch, r, c), (stride * it, it, ld * it))
    return x.transpose(0, 2, 1) if trans else x


class _Cublas(types.ModuleType):
    CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
    CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F = 68, 77, 70
    CUBLAS_GEMM_DEFAULT, CUBLAS_GEMM_DEFAULT_TENSOR_OP = -1, 99

    def gemmStridedBatchedEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
                             strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
        dtype = {0: numpy.float32, 1: numpy.float64}[Ctype]
        if not Atype == Btype == Ctype:
            raise TypeError("fake cuBLAS: mixed operand types")
        if (dtype == numpy.float64) != (computeType == self.CUBLAS_COMPUTE_64F):
            raise TypeError(f"fake cuBLAS: compute type {computeType} for {numpy.dtype(dtype)}")
        a = numpy.frombuffer((ctypes.c_char * numpy.dtype(dtype).itemsize).from_address(alpha), dtype)[0]
        b = numpy.frombuffer((ctypes.c_char * numpy.dtype(dtype).itemsize).from_address(beta), dtype)[0]
        opA = _col_major(A, dtype, transa == self.CUBLAS_OP_T, m, k, lda, strideA, batchCount)   # (batch, m, k)
        opB = _col_major(B, dtype, transb == self.CUBLAS_OP_T, k, n, ldb, strideB, batchCount)   # (batch, k, n)
        c = _col_major(C, dtype, False, m, n, ldc, strideC, batchCount)                          # (batch, m, n)
        COUNTS.launch("cublas:gemmStridedBatchedEx")
        COUNTS.compute_types.append(computeType)
        result = a * numpy.matmul(opA, opB) + (b * c if b else 0)
        c[...] = result


class _Stream:
    def synchronize(self):
        COUNTS.sync("stream.synchronize()")


class _Device:
    def __init__(self, i=0):
        self.id, self.compute_capability = i, "90"

    def synchronize(self):
        COUNTS.sync("device.synchronize()")


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


cublas = _Cublas("cupy.cuda.cublas")
runtime = _module("cupy.cuda.runtime", CUDA_R_32F=0, CUDA_R_64F=1, getDeviceCount=lambda: 1,
                  deviceSynchronize=lambda: COUNTS.sync("deviceSynchronize()"))
cuda = _module("cupy.cuda", is_available=lambda: True, get_current_stream=lambda: _Stream(), Device=_Device,
               runtime=runtime, cublas=cublas,
               device=_module("cupy.cuda.device", get_cublas_handle=lambda: 0, Device=_Device))


@contextlib.contextmanager
def installed():
    """minivit sees this module as CuPy (a "GPU") inside the block; the real state is put back after."""
    from minivit import backend
    from minivit.fast import cuda as fast_cuda   # (cuda, here, is the stand-in's cupy.cuda)
    from minivit.fast import ops

    special = _module("cupyx.scipy.special", erf=_scipy_erf)
    scipy_ = _module("cupyx.scipy", special=special)
    modules = {"cupy": sys.modules[__name__], "cupy.cuda": cuda, "cupy.cuda.cublas": cublas,
               "cupy.cuda.runtime": runtime, "cupyx": _module("cupyx", scipy=scipy_), "cupyx.scipy": scipy_,
               "cupyx.scipy.special": special}
    saved = {name: sys.modules.get(name) for name in modules}
    state = (backend._cupy, backend._current, dict(fast_cuda._compiled))
    sys.modules.update(modules)
    backend._cupy = None
    fast_cuda._compiled.clear()
    ops.reset()
    COUNTS.reset()
    try:
        yield COUNTS
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        backend._cupy, backend._current = state[0], state[1]
        fast_cuda._compiled.clear()
        fast_cuda._compiled.update(state[2])
        ops.reset()
