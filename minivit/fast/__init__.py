"""minivit.fast: where speed lives, kept apart from the math a student reads (as llm.c keeps llmc/ apart
from train_gpt2.c).

functional.py, layers.py and model.py are the reference: they run, and they are what is checked. This
subpackage computes some of the same numbers faster, for float32, and never decides what the numbers are:

    ops.py        the dispatch: per op, functional.py's pair or a twin from kernels.py, the twin only after a
                  probe in this process shows it agrees with the pair as it stands (``minivit.ops``)
    kernels.py    the twins, each named like the pair it replaces; they send NumPy arrays to cpu.py, CuPy
                  arrays to cuda.py, attention to attention.py (``minivit.kernels``)
    cpu.py        Numba loops: GELU, LayerNorm, softmax, attention's softmax, AdamW
    cuda.py       CUDA source compiled by CuPy, and cuBLAS's batched products
    attention.py  fused attention on both backends, in chunks, the N x N weights never stored
    report.py     what each layer of a model ran, recorded (``ops.report(model)``)
    amp.py        mixed precision: float16 products and the loss scaler (``minivit.amp``)

layers.py imports only the dispatch, ops.py. The old names (minivit.ops, minivit.kernels, minivit.amp,
minivit.ops_report) are these modules themselves (minivit/_moved.py). This file imports nothing, so
naming the subpackage costs nothing; ``import minivit`` imports ops.py and amp.py.
"""
