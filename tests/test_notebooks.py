"""The lessons: every notebook runs top to bottom in quick mode, and the committed ones read well.

Each notebook is executed with nbclient in a temporary copy of notebooks/ (so the committed outputs are
never overwritten), with MINIVIT_QUICK=1. The kernel gets:
- PYTHONPATH = this checkout, so it imports this minivit even where the venv's editable install is stale;
- MINIVIT_BACKEND=numpy: the lessons compute with NumPy arrays (lesson 8 picks the GPU itself when full);
- OPENBLAS_NUM_THREADS=1: on a machine whose cores are shared (our two-core CI box), multi-threaded
  BLAS makes small matrix products up to a hundred times slower at random, and the quick runs are
  mostly small products. One thread keeps them fast and their timings meaningful.
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
LESSONS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT = 300          # seconds per cell; the slowest quick cell (lesson 10's five trainings) takes ~10 s
NOTEBOOK_BUDGET = 240       # seconds per notebook in quick mode; each takes well under a minute on 2 cores


def _read(name):
    with open(NOTEBOOKS / name, encoding="utf-8") as f:
        return json.load(f)


def _source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_the_ten_lessons_are_there_in_order():
    assert [name[:3] for name in LESSONS[:10]] == [f"{i:02d}_" for i in range(1, 11)], LESSONS


@pytest.mark.parametrize("name", LESSONS)
def test_committed_notebook_is_small_clean_and_shaped_like_a_lesson(name):
    nb = _read(name)
    size = (NOTEBOOKS / name).stat().st_size
    assert size < 500_000, f"{name} is {size / 1e3:.0f} KB; keep committed notebooks under 500 KB"
    cells = nb["cells"]
    assert cells[0]["cell_type"] == "markdown" and "What you will learn" in _source(cells[0]), \
        f"{name} must start by saying what the student will learn"
    assert "What to try next" in "".join(_source(c) for c in cells[-2:] if c["cell_type"] == "markdown"), \
        f"{name} must end with what to try next"
    code = [c for c in cells if c["cell_type"] == "code"]
    assert any('os.environ.get("MINIVIT_QUICK") == "1"' in _source(c) for c in code[:2]), \
        f"{name} must read MINIVIT_QUICK in its first cells"
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{name}: commit the outputs of one run, top to bottom ({counts})"
    for c in code:
        for out in c["outputs"]:
            assert out["output_type"] != "error", f"{name}: a committed cell shows an error"
    assert any("image/png" in o.get("data", {}) for c in code for o in c["outputs"]), f"{name} has no figure"


MIN_FIGURE_WIDTH = 600     # px: at notebook width a narrower figure's labels are too small to read (issue 31)


@pytest.mark.parametrize("name", LESSONS)
def test_every_committed_figure_is_wide_enough_to_read(name):
    import base64
    import io

    from PIL import Image

    narrow = []
    for i, cell in enumerate(_read(name)["cells"]):
        for out in cell.get("outputs", []):
            for kind in ("image/png", "image/jpeg"):
                if kind in out.get("data", {}):
                    width, height = Image.open(io.BytesIO(base64.b64decode(out["data"][kind]))).size
                    if width < MIN_FIGURE_WIDTH:
                        narrow.append(f"cell {i}: {width}x{height} px")
    assert not narrow, (f"{name}: figures under {MIN_FIGURE_WIDTH} px wide ({'; '.join(narrow)}); widen figsize "
                        "(a JPEG via viz.show_jpeg keeps a wide picture small)")


ANSWERS_OPEN = "<details><summary><b>Short answers</b>"


@pytest.mark.parametrize("name", LESSONS)
def test_every_try_next_item_has_a_short_answer(name):
    # the last cell holds the answers, collapsed, one bullet per item of "What to try next" just above it
    cells = [_source(c) for c in _read(name)["cells"] if c["cell_type"] == "markdown"]
    questions, answers = cells[-2], cells[-1]
    assert "What to try next" in questions, f"{name}: 'What to try next' must come just before the answers"
    assert answers.lstrip().startswith(ANSWERS_OPEN) and answers.rstrip().endswith("</details>"), \
        f"{name}: end with the short answers in a collapsed <details> cell"
    start = questions.index("What to try next")
    items = re.findall(r"^\* ", questions[start:], re.M)
    bullets = re.findall(r"^\* ", answers, re.M)
    assert len(items) >= 1 and len(bullets) == len(items), \
        f"{name}: {len(items)} items to try and {len(bullets)} answers; give one answer per item"
    assert "TODO" not in answers, f"{name}: an answer is still a TODO"


def _minivit_classes():
    """{class name: [classes]} of every class defined in a minivit module."""
    import importlib
    import inspect
    import pkgutil

    import minivit

    classes = {}
    for info in pkgutil.walk_packages(minivit.__path__, "minivit."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:                     # an optional dependency missing here
            continue
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                classes.setdefault(name, []).append(obj)
    return classes


def test_a_method_the_lessons_point_at_is_in_that_class():
    # "read `ViT.forward`" sends a student to a class whose body does not have it (it is Classifier's): a pointer
    # `Class.method` in a lesson's text must name a class that defines the method itself
    classes = _minivit_classes()
    pointers = 0
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")) + sorted(NOTEBOOKS.glob("exercises/[0-9][0-9]_*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            if cell["cell_type"] != "markdown":
                continue
            for cls, attr in re.findall(r"`([A-Z]\w*)\.([a-z_]\w*)(?:\([^`]*\))?`", _source(cell)):
                if cls in classes:
                    pointers += 1
                    assert any(attr in vars(c) for c in classes[cls]), \
                        f"{path.name}, cell {i}: `{cls}.{attr}` is not in class {cls}'s body (inherited?): " \
                        "name the class that has it"
    assert pointers > 0


def test_the_index_lists_every_lesson():
    index = (NOTEBOOKS / "README.md").read_text(encoding="utf-8")
    for name in LESSONS:
        assert name in index, f"notebooks/README.md does not list {name}"


def test_the_photograph_is_shipped_with_its_licence():
    photo = NOTEBOOKS / "assets" / "astronaut.jpg"
    assert photo.exists() and photo.stat().st_size < 40_000
    from PIL import Image

    with Image.open(photo) as im:
        assert im.size == (224, 224) and im.mode == "RGB"
    assert re.search(r"public domain", (NOTEBOOKS / "assets" / "README.md").read_text(), re.I)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A temporary copy of notebooks/ (notebooks and assets only), shared by the executions."""
    base = tmp_path_factory.mktemp("lessons")
    dest = base / "notebooks"
    dest.mkdir()
    for name in LESSONS:
        shutil.copy(NOTEBOOKS / name, dest / name)
    shutil.copytree(NOTEBOOKS / "assets", dest / "assets")
    shutil.copy(NOTEBOOKS / "claims.py", dest / "claims.py")     # what the lessons import to check their prose
    return dest


def _fashion_mnist_folder():
    """Where the lessons will find Fashion-MNIST, as their first cell looks: None (Debian's folder), the folder
    MINIVIT_FASHION_MNIST names or the checkout's data/; False when it is in none of them."""
    from minivit.data import load_dataset

    given = os.environ.get("MINIVIT_FASHION_MNIST")
    for folder in [given] if given else [None, str(ROOT / "data")]:
        try:
            load_dataset("fashion-mnist", data_dir=folder)
            return folder
        except FileNotFoundError:
            pass
    return False


@pytest.mark.slow
@pytest.mark.parametrize("name", LESSONS)
def test_notebook_runs_top_to_bottom_in_quick_mode(name, workdir, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MINIVIT_QUICK", "1")
    monkeypatch.setenv("MINIVIT_BACKEND", "numpy")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("MINIVIT_CHECK_CLAIMS", "1")          # a claim the run does not show fails its cell
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    committed = (NOTEBOOKS / name).read_bytes()
    if "needs Fashion-MNIST" in committed.decode("utf-8"):      # lessons 15, 16: they stop without it, by design
        folder = _fashion_mnist_folder()
        if folder is False:
            pytest.skip(f"{name} needs Fashion-MNIST: apt-get install dataset-fashion-mnist, or "
                        f"python data_scripts/download_fashion_mnist.py (tests/test_lesson_data.py checks the stop)")
        if folder is not None:                  # the copy in workdir cannot see the checkout's ../data
            monkeypatch.setenv("MINIVIT_FASHION_MNIST", folder)
    nb = nbformat.read(workdir / name, as_version=4)
    for cell in nb.cells:                       # run from a clean slate, not on top of committed outputs
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    start = time.perf_counter()
    client.execute()                            # raises CellExecutionError, with the traceback, on any error
    seconds = time.perf_counter() - start
    print(f"{name}: {seconds:.1f} s")
    assert seconds < NOTEBOOK_BUDGET, f"{name} took {seconds:.0f} s in quick mode (budget {NOTEBOOK_BUDGET} s)"
    figures = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert figures >= 1, f"{name} drew no figure"
    assert (NOTEBOOKS / name).read_bytes() == committed, "running a lesson must not touch the committed notebook"


def test_a_claim_says_whether_the_run_shows_it_and_fails_under_the_suite(monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("claims", NOTEBOOKS / "claims.py")
    claims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(claims)
    monkeypatch.delenv("MINIVIT_CHECK_CLAIMS", raising=False)
    monkeypatch.delenv("MINIVIT_QUICK", raising=False)
    assert claims.claim("a beats b", 2 > 1, "2 against 1") is True
    assert claims.claim("b beats a", 1 > 2, "1 against 2") is False         # in Jupyter: said, not raised
    assert capsys.readouterr().out.splitlines() == ["shown: a beats b (2 against 1)",
                                                    "NOT SHOWN by this run: b beats a (1 against 2)"]
    monkeypatch.setenv("MINIVIT_CHECK_CLAIMS", "1")
    with pytest.raises(AssertionError, match="the lesson says 'b beats a', but its own run does not show it"):
        claims.claim("b beats a", False, "1 against 2")
    monkeypatch.setenv("MINIVIT_QUICK", "1")                                # a full-mode claim in quick mode
    assert claims.claim("long runs show it", False, full_only=True) is False
    assert "stated for full mode" in capsys.readouterr().out
    with pytest.raises(TypeError, match="non-empty string"):
        claims.claim("", True)
