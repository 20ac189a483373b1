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

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minivit"

# Bottom to top. A module may import only from a lower level; the modules of one level know nothing of
# each other. A new file goes in here on purpose (the test fails until it does).
LEVELS = [
    ("_blas_env",),                 # a setting NumPy's BLAS reads when NumPy loads: imports nothing of minivit
    ("backend",),                   # NumPy or CuPy: the only module that knows CuPy
    ("functional",),                # the math: pure forward/backward pairs
    ("kernels",),                   # the fast kernels, each named like the pair it replaces
    ("ops_report",),                # what each layer of a model ran, recorded (ops.report(model) calls it)
    ("ops",),                       # the table that chooses, per op, between functional and kernels
    ("layers", "amp"),              # the building blocks over the pairs; mixed precision's loss scaler
    ("conv", "layer_examples"),     # convolution pairs and layers...; layers a student might write, worked
    ("gradcheck",),                 # checks any layer's backward against central differences
    ("model",),                     # ViTConfig, param_shapes, flops, Classifier, ViT, trace, presets
    ("hf",),                        # Hugging Face transformers folders (ViT, CLIP): below convert and clip, which call it
    ("resnet", "clip"),             # models built on the ViT's parts: the CNN baseline, CLIP (branch clip)
    ("optim", "augment", "data", "download", "stats"),  # what training uses beside the model
    ("captions",),                  # captioned images for CLIP, built on data (branch clip)
    ("checkpoint", "distributed"),  # the trainer's .npz files; data parallelism over MPI and NCCL
    ("clip_train",),                # CLIP's task for the trainer: its data, batches, step (on R ranks too), evaluation
    ("convert",),                   # published checkpoints (timm, JAX) and from_pretrained: above the model
    ("viz", "plot"),                # pictures: attention maps and patches, training curves
    ("train", "predict", "check"),  # what a person runs: the trainer and the other command lines
]
LEVEL = {name: i for i, names in enumerate(LEVELS) for name in names}
PACKAGE_LEVEL = len(LEVELS)         # ``import minivit`` from inside it: the package imports everything


def minivit_imports(path):
    """(line, module) for every import of a minivit module in the file: `from . import x`, `from .x import y`,
    `from minivit.x import y`, `import minivit.x`; "minivit" for the package itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level > 1:
                raise AssertionError(f"{path.name}:{node.lineno}: minivit has no subpackages to import from")
            if node.level == 1:
                base = node.module
            elif node.module == "minivit" or (node.module or "").startswith("minivit."):
                base = node.module[len("minivit."):] if node.module != "minivit" else None
            else:
                continue
            if base is None:        # from . import a, b   /   from minivit import a, b
                found += [(node.lineno, alias.name) for alias in node.names]
            else:
                found.append((node.lineno, base.split(".")[0]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "minivit":
                    found.append((node.lineno, "minivit"))
                elif alias.name.startswith("minivit."):
                    found.append((node.lineno, alias.name.split(".")[1]))
    return found


def modules():
    return sorted(p for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def test_every_module_has_a_level():
    missing = [p.name for p in modules() if p.stem not in LEVEL]
    assert not missing, f"place {missing} in LEVELS at the top of tests/test_structure.py"


def test_imports_run_one_way():
    upward = []
    for path in modules():
        here = path.stem
        for line, there in minivit_imports(path):
            level = PACKAGE_LEVEL if there == "minivit" else LEVEL.get(there)
            if level is None:
                upward.append(f"minivit/{path.name}:{line} imports {there!r}, which is not in LEVELS")
            elif level >= LEVEL[here]:
                upward.append(f"minivit/{path.name}:{line}: {here} (level {LEVEL[here]}) imports {there} "
                              f"(level {level}), which is not below it")
    assert not upward, "imports that do not run one way:\n  " + "\n  ".join(upward)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "layers.py"
    source.write_text("from . import functional as F\n\ndef f():\n    from .model import ViT\n"
                      "    import minivit.train\n    from minivit import convert, data\n")
    assert minivit_imports(source) == [(1, "functional"), (4, "model"), (5, "train"), (6, "convert"), (6, "data")]


# --------------------------------------------------------------------------------------------------
# What `import minivit` gives
# --------------------------------------------------------------------------------------------------


MODULES = ["amp", "augment", "backend", "checkpoint", "conv", "convert", "data", "download", "functional",
           "kernels", "layers", "model", "optim", "plot", "predict", "resnet", "stats", "train", "viz"]


@pytest.mark.parametrize("name", MODULES + ["ops", "check"])
def test_every_module_is_an_attribute(name):
    if not (PACKAGE / f"{name}.py").exists():
        pytest.skip(f"minivit/{name}.py does not exist (yet)")
    module = getattr(minivit, name)
    assert isinstance(module, types.ModuleType) and module.__name__ == f"minivit.{name}"
    assert name in dir(minivit)


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
    assert {"minivit.ViT", "minivit.convert.to_timm", "minivit.amp.LossScaler"} <= set(names), names


@pytest.mark.parametrize("dotted", readme_names())
def test_each_name_the_readme_shows_resolves(dotted):
    obj = minivit
    for part in dotted.split(".")[1:]:
        assert hasattr(obj, part), f"the README writes {dotted}, but {obj.__name__ if hasattr(obj, '__name__') else obj}" \
                                   f" has no attribute {part!r}"
        obj = getattr(obj, part)


def test_import_minivit_stays_light():
    """`import minivit` loads none of what only training, data sets or pictures need: those come with
    minivit.train, minivit.data, minivit.viz..., the first time they are named. (Numba, and SciPy with it,
    do load: layers -> ops -> kernels, since issue 12.)"""
    heavy = ("matplotlib", "PIL", "tqdm")
    code = ("import sys, minivit; "
            f"print(' '.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], f"import minivit imported {out.stdout.split()}"
