"""The package's shape: imports run one way, `import minivit` gives what the README shows, and stays quick.

The import-direction test reads every ``import`` in minivit/*.py from the source (also those inside
functions) and fails on one that goes from a module to a module of its own level or a higher one in
LEVELS: no circles, and the bottom (backend, functional) never learns of what is built on it.
"""

import ast
import importlib
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import minivit
from minivit._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minivit"

# Bottom to top. A module may import only from a lower level; the modules of one level know nothing of
# each other. A new file goes in here on purpose (the test fails until it does).
LEVELS = [
    ("_blas_env",),                 # a setting NumPy's BLAS reads when NumPy loads: imports nothing of minivit
    ("_moved",),                    # old import paths of modules that moved into a subpackage: imports only importlib
    ("memory",),                    # bytes available, checked before a reader allocates: imports nothing of minivit
    ("backend",),                   # NumPy or CuPy: the only module that knows CuPy
    ("functional",),                # the math: pure forward/backward pairs
    ("fast.cpu", "fast.cuda"),      # the fast kernels' rooms: Numba loops; CUDA source and cuBLAS
    ("fast.attention",),            # fused attention over both rooms, in chunks, the N x N weights never kept
    ("fast.kernels",),              # the twins, each named like the pair it replaces (old minivit.kernels)
    ("fast.report",),               # what each layer of a model ran, recorded (ops.report(model) calls it)
    ("fast.ops",),                  # the dispatch: chooses, per op, between functional and fast.kernels
    ("fast",),                      # minivit/fast/__init__.py: the subpackage's map, imports nothing
    ("layers", "fast.amp"),         # the building blocks over the pairs; mixed precision's loss scaler
    ("conv", "embeddings", "layer_examples",  # convolution pairs and layers...; how an image becomes tokens
     "clip.loss", "mae.masking",    # (PatchEmbed, PosEmbed, GridPosEmbed, Embedding); layers a student might write;
     "mae.loss", "deit.loss"),      # CLIP's joint space and contrastive loss (on one rank of R too); MAE's
                                    # masking (gather / scatter, unshuffle) and its loss on the removed patches;
                                    # DeiT's hard and soft distillation losses
    ("gradcheck",),                 # checks any layer's backward against central differences
    ("model",),                     # ViTConfig, param_shapes, flops, Classifier, ViT, trace, presets
    ("weights.hf",),                # Hugging Face transformers folders (ViT, CLIP): below convert and clip,
                                    # which call it
    ("resnet", "clip.model",        # models built on the ViT's parts: the CNN baseline, CLIP's towers and config;
     "clip.zero_shot", "mae.model",  # a trained CLIP used: features, zero-shot classification, retrieval; MAE;
     "deit.model"),                 # DeiT's distilled ViT (the distillation token, head_dist)
    ("clip", "mae"),                # CLIP's every public name (loss, model, zero_shot); MAE's (masking, loss, model)
    ("optim", "train.stats",        # what training uses beside the model; the data sets' parts below data:
     "data.augment", "data.download", "data.dataset"),  # batch augmentation, the network, the Dataset record
    ("data.cifar", "data.fashion_mnist", "data.folders", "data.synthetic"),  # the readers, and sets drawn
    ("data",),                      # load_dataset, and every reader's public name
    ("clip.captions",),             # CLIP's tokenizers and captioned images, built on data
    ("weights.checkpoint",          # the trainer's .npz files;
     "distributed.communicators"),  # the ranks: launcher, collectives on MPI and NCCL, faults
    ("weights.files",               # checkpoint files told apart by their content (JAX, timm, minivit);
     "distributed.data_parallel"),  # data parallelism on them: slices, flat gradients, all-reduce or ZeRO-1
    ("distributed",),               # distributed/__init__.py: both rooms' public names
    ("clip.task", "mae.task"),      # CLIP's task for the trainer: its data, batches, step (on R ranks too), evaluation;
                                    # MAE's (pre-training, a k-NN probe) and the fine-tuning from its checkpoint
    ("weights.convert",),           # published checkpoints (timm, JAX) and from_pretrained: above the model
    ("weights",),                   # weights/__init__.py: checkpoint, convert and hf's most used names
    ("viz", "train.plot",           # pictures: attention maps and patches, training curves;
     "deit.weights"),               # timm's DeiT distilled checkpoints, --distill's checkpoints (built on convert)
    ("deit",),                      # DeiT's every public name (loss, model, weights)
    ("train.config",),              # the trainer's settings: TrainConfig, the recipes, resolve, the flags' parser
    ("train.run_folder",),          # the run folder: its lock, metrics, summary, atomic writes, resume's checks
    ("train.tasks",),               # what a run trains, one interface: the classifier here, CLIP in clip.task
    ("deit.task",),                 # --distill: the classifier's task with a teacher and the distillation loss
    ("train.loop",),                # train(): set_up, run_loop, evaluate_and_save, finish; signals; main
    ("train", "predict"),           # what a person runs: the trainer (train/__init__.py) and the prediction command
    ("check.report",),              # minivit.check's rows, table and diagnoses; replaced()
    ("check.compare",),             # the comparisons every check is made of; the textbook forwards
    ("check.walk", "check.overfit"),  # the model walk (run_model); a tiny ViT overfit on one batch
    ("check.ops",),                 # one check per op, OPS, run (the "model" op walks its layers)
    ("check.command",),             # python -m minivit.check's argument parsing and output
    ("check",),                     # check/__init__.py: the public API, gathered from the modules above
    ("check.__main__", "train.__main__"),  # python -m minivit.check, python -m minivit.train
]
LEVEL = {name: i for i, names in enumerate(LEVELS) for name in names}
PACKAGE_LEVEL = len(LEVELS)         # ``import minivit`` from inside it: the package imports everything


def module_name(path):
    """minivit/fast/cpu.py -> "fast.cpu"; a subpackage's __init__.py is the subpackage: "fast"."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def minivit_imports(path, package=PACKAGE):
    """(line, module) for every import of a minivit module in the file: `from . import x`, `from .x import y`,
    `from ..x import y`, `from minivit.x import y`, `import minivit.x.y`, as a dotted name below minivit
    ("fast.cpu"), the longest that is a module or subpackage; "minivit" for the package itself."""
    rel = path.resolve().relative_to(package.resolve()) if path.resolve().is_relative_to(package.resolve()) else None
    here = list(rel.parts[:-1]) if rel is not None else []      # the file's own subpackage, [] at the top
    known = {module_name(p) for p in modules()}

    def longest(dotted):
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                return ".".join(parts[:n])
        return parts[0]

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = here[:len(here) - (node.level - 1)] if node.level - 1 <= len(here) else None
                if up is None:
                    raise AssertionError(f"{path.name}:{node.lineno}: a relative import above minivit")
                base = ".".join(up + ([node.module] if node.module else []))
            elif node.module == "minivit" or (node.module or "").startswith("minivit."):
                base = node.module[len("minivit."):] if node.module != "minivit" else ""
            else:
                continue
            for alias in node.names:                    # `from .fast import cpu`: cpu may be a module
                full = f"{base}.{alias.name}" if base else alias.name
                found.append((node.lineno, longest(full) if full in known or not base else longest(base)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "minivit":
                    found.append((node.lineno, "minivit"))
                elif alias.name.startswith("minivit."):
                    found.append((node.lineno, longest(alias.name[len("minivit."):])))
    return sorted(set(found), key=found.index)


def modules():
    """Every module of the package (subpackages' files too), but not the package's own __init__.py."""
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py" and "__pycache__" not in p.parts)


def test_every_module_has_a_level():
    missing = [module_name(p) for p in modules() if module_name(p) not in LEVEL]
    assert not missing, f"place {missing} in LEVELS at the top of tests/test_structure.py"


# The only imports that may go up: inside a function body (run when it is called, never when the module
# loads, so no circle), each named here with the reason. Nothing else of the rule bends.
CALL_TIME_UP = {
    ("model", "weights.convert"): "ViT.from_pretrained, transformers' spelling, hands over to convert.from_pretrained",
    ("deit.model", "deit.weights"): "DistilledViT.from_pretrained hands over to deit.weights.from_pretrained",
    ("train.tasks", "deit.task"): "task_type hands --distill to DistillTask, which builds on ClassificationTask",
    ("weights.convert", "deit.weights"): "from_pretrained hands a DeiT distilled checkpoint to deit's loader",
    ("weights.checkpoint", "deit.weights"): "load_model hands a --distill run's checkpoint to deit's load_model",
}


def imports_inside_functions(path):
    """The line numbers of the imports written inside a function's body."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def test_imports_run_one_way():
    upward = []
    for path in modules():
        here = module_name(path)
        where = path.relative_to(PACKAGE)
        inside = imports_inside_functions(path)
        for line, there in minivit_imports(path):
            if there == here or (here.startswith(there + ".") and path.name == "__main__.py"):
                continue                      # a subpackage's __main__ runs the subpackage it sits in
            if (here, there) in CALL_TIME_UP and line in inside:
                continue
            level = PACKAGE_LEVEL if there == "minivit" else LEVEL.get(there)
            if level is None:
                upward.append(f"minivit/{where}:{line} imports {there!r}, which is not in LEVELS")
            elif level >= LEVEL[here]:
                upward.append(f"minivit/{where}:{line}: {here} (level {LEVEL[here]}) imports {there} "
                              f"(level {level}), which is not below it")
    assert not upward, "imports that do not run one way:\n  " + "\n  ".join(upward)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "layers.py"
    source.write_text("from . import functional as F\n\ndef f():\n    from .model import ViT\n"
                      "    import minivit.train\n    from minivit import convert, data\n")
    assert minivit_imports(source) == [(1, "functional"), (4, "model"), (5, "train"), (6, "convert"), (6, "data")]


def test_the_checker_reads_subpackages(tmp_path):
    """In minivit/sub/a.py, `.b` is sub.b, `..layers` is layers, and `from . import b` names the module sub.b."""
    package = tmp_path / "minivit"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "layers.py", "sub/__init__.py", "sub/b.py"):
        (package / name).write_text("")
    source = package / "sub" / "a.py"
    source.write_text("from . import b\nfrom .b import f\nfrom .. import layers\nfrom ..layers import Linear\n"
                      "import minivit.sub.b\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, package
    try:
        assert minivit_imports(source, package) == [(1, "sub.b"), (2, "sub.b"), (3, "layers"), (4, "layers"),
                                                   (5, "sub.b")]
    finally:
        PACKAGE = saved


# --------------------------------------------------------------------------------------------------
# What `import minivit` gives
# --------------------------------------------------------------------------------------------------


MODULES = ["amp", "augment", "backend", "checkpoint", "clip_train", "conv", "convert", "data", "download", "embeddings",
           "fast", "functional", "hf", "kernels", "layers", "model", "optim", "plot", "predict", "resnet", "stats",
           "train", "viz", "weights"]


@pytest.mark.parametrize("name", MODULES + ["ops", "check", "clip", "captions"])
def test_every_module_is_an_attribute(name):
    """Each name is an attribute of the package: a module (data.py) or a subpackage (data/) of that name, or,
    for a module that moved into a subpackage, its new place under its old name (minivit/_moved.py)."""
    module = getattr(minivit, name)
    expected = MOVED.get(f"minivit.{name}", f"minivit.{name}")
    assert isinstance(module, types.ModuleType) and module.__name__ == expected
    assert name in dir(minivit)


def test_a_moved_module_keeps_its_old_import_path(monkeypatch):
    """An entry of minivit._moved.MOVED makes the old name the same module object as the new one, as an
    import, a `from ... import`, and an attribute of the package."""
    from minivit import _moved
    monkeypatch.setitem(_moved.MOVED, "minivit.old_math_for_test", "minivit.functional")
    monkeypatch.delitem(sys.modules, "minivit.old_math_for_test", raising=False)
    import minivit.old_math_for_test as old
    from minivit.old_math_for_test import cross_entropy
    assert old is minivit.functional and cross_entropy is minivit.functional.cross_entropy
    assert minivit.old_math_for_test is minivit.functional and "old_math_for_test" in dir(minivit)
    monkeypatch.delattr(minivit, "old_math_for_test")
    monkeypatch.delitem(sys.modules, "minivit.old_math_for_test")


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_import_path_resolves(old):
    new = importlib.import_module(old)
    assert new.__name__ == MOVED[old]
    assert new.__spec__.name == MOVED[old], "the alias must not leave the old name's spec on the module"


def test_a_moved_command_runs_under_its_old_name(tmp_path):
    """`python -m minivit.plot` (now minivit/train/plot.py) still runs the command: its --help, and its
    refusal of a folder without metrics, exactly as `python -m minivit.train.plot` does. (The new name's
    runpy warns that `import minivit.train` loaded plot already; the command's name stays minivit.plot.)"""
    for name in ("minivit.plot", "minivit.train.plot"):
        shown = subprocess.run([sys.executable, "-m", name, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert shown.returncode == 0 and "Plot training curves" in shown.stdout, (name, shown.stderr)
        assert name != "minivit.plot" or shown.stderr == "", shown.stderr
        refused = subprocess.run([sys.executable, "-m", name, str(tmp_path)], cwd=ROOT, capture_output=True,
                                 text=True)
        assert refused.returncode == 2 and "no metrics at" in refused.stderr, (name, refused.stderr)


# Every top-level name of minivit/kernels.py before issue 30 split it into minivit/fast/'s rooms
OLD_KERNELS_NAMES = """
    AttentionCache CHUNK_BYTES GPU_CHUNK_BYTES HAVE_NUMBA PARALLEL_MIN ROWS_PER_GROUP THREADED_ATTENTION
    _ADAMW_BODY _ADAMW_PARAMS _C_INV_SQRT_2 _C_INV_SQRT_2PI _C_QUICK _C_SQRT_2_OVER_PI _E0 _E1 _E2 _E3 _E4
    _E5 _ERF_P _ERF_Q _EXP_C _FASTMATH _GELU_ERF_BWD _GELU_ERF_FWD _GELU_QUICK_BWD _GELU_QUICK_FWD
    _GELU_TANH_BWD _GELU_TANH_FWD _INV_SQRT_2 _INV_SQRT_2PI _KEEP_MASK_BODY _LN2_HI _LN2_LO _LOG2E _P0 _P1
    _P2 _P3 _P4 _P5 _P6 _Q0 _Q1 _Q2 _Q3 _Q4 _ROW_SOURCE _SGD_BODY _SGD_MOMENTUM_BODY _SQRT_2_OVER_PI _adamw
    _attention_operands _attention_workers _batch_layout _blas_control _blas_env _chunk_pool _chunks
    _compiled _cupy _elementwise _erf32 _exp32 _flat _fused_attention_backward _fused_attention_forward
    _gelu_cpu _gelu_erf_bwd _gelu_erf_fwd _gelu_quick_bwd _gelu_quick_fwd _gelu_tanh_bwd _gelu_tanh_fwd
    _gpu_layernorm_backward _gpu_layernorm_forward _gpu_matmul _gpu_rows _gpu_softmax_backward
    _gpu_softmax_forward _gpu_softmax_lse _gpu_softmax_lse_bwd _heads _in_thread _inline _is_cupy _jit
    _kernel _launch_rows _layernorm_backward_cpu _layernorm_bwd _layernorm_forward_cpu _layernorm_fwd
    _mask_in_score_units _parallel_lock _row_kernel _row_max _rows _run_chunks _scaled_softmax_row
    _softmax_backward_cpu _softmax_bwd _softmax_forward_cpu _softmax_fwd _softmax_lse _softmax_lse_bwd
    _tanh32 _threads_set _three_heads _use_threads adamw_update attention_backward attention_forward
    dropout_keep_mask f32 gelu_backward gelu_forward layernorm_backward layernorm_forward linear_backward
    linear_forward math num_threads numba numpy os prange sgd_update softmax_backward softmax_forward
    supports_adamw supports_sgd tf32_enabled threading threadpoolctl types
""".split()


def test_the_old_kernels_module_still_offers_every_name_it_had():
    """minivit.kernels is minivit.fast.kernels; a name that moved on to fast.cpu, .cuda or .attention is
    found there (a setting, such as CHUNK_BYTES, is read in its room: set it there)."""
    import minivit.kernels as kernels
    from minivit.fast import attention

    missing = [name for name in OLD_KERNELS_NAMES if not hasattr(kernels, name)]
    assert not missing, f"minivit.kernels lost {missing}"
    assert kernels.CHUNK_BYTES == attention.CHUNK_BYTES and kernels._chunks is attention._chunks
    with pytest.raises(AttributeError, match="no attribute 'not_a_kernel'"):
        kernels.not_a_kernel


def test_gradcheck_is_the_function_and_unknown_names_are_refused():
    assert minivit.gradcheck is importlib.import_module("minivit.gradcheck").gradcheck   # as the README calls it
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        minivit.trian


def readme_names():
    """Every dotted minivit.X.Y the README writes (in code and in prose)."""
    text = (ROOT / "README.md").read_text()
    return sorted(set(re.findall(r"\bminivit(?:\.[A-Za-z_]\w*)+", text)))


def test_the_readme_finds_names():
    names = readme_names()
    assert {"minivit.ViT", "minivit.weights.convert.to_timm", "minivit.fast.amp.LossScaler"} <= set(names), names


@pytest.mark.parametrize("dotted", readme_names())
def test_each_name_the_readme_shows_resolves(dotted):
    obj = minivit
    for part in dotted.split(".")[1:]:
        assert hasattr(obj, part), f"the README writes {dotted}, " \
                                   f"but {obj.__name__ if hasattr(obj, '__name__') else obj}" \
                                   f" has no attribute {part!r}"
        obj = getattr(obj, part)


def test_import_minivit_stays_light():
    """`import minivit` loads none of what only training, data sets or pictures need: those come with
    minivit.train, minivit.data, minivit.viz..., the first time they are named. (Numba, and SciPy with it,
    do load: layers -> fast.ops -> fast.kernels -> fast.cpu, since issue 12.)"""
    heavy = ("matplotlib", "PIL", "tqdm")
    code = ("import sys, minivit; "
            f"print(' '.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], f"import minivit imported {out.stdout.split()}"


def test_a_layer_moved_to_embeddings_says_where_it_went():
    """PatchEmbed, PosEmbed... left layers.py for embeddings.py (which builds on it, so layers cannot
    re-export them): the old name raises, naming the new place."""
    for name in minivit.layers.MOVED_TO_EMBEDDINGS:
        assert hasattr(minivit.embeddings, name), name
        with pytest.raises(AttributeError, match=f"{name} moved to minivit.embeddings: use minivit.embeddings.{name}"):
            getattr(minivit.layers, name)
    with pytest.raises(AttributeError, match="has no attribute 'Linaer'"):
        minivit.layers.Linaer


def test_no_module_does_two_jobs():
    """Issue 30: a file past ~600 lines is doing two jobs (shared/STYLE.md); none may pass 700."""
    long = {str(p.relative_to(ROOT)): n for p in modules() if (n := len(p.read_text().splitlines())) > 700}
    assert not long, f"split these modules (lines): {long}"
