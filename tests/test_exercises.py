"""The exercises (notebooks/exercises/): every check cell says WRONG with the stub and RIGHT with the solution.

Each exercise notebook is run twice in this process, its code cells exec'd in order in a fresh namespace
(fast: no kernel to start): as committed, where every check cell's `report` must fail, and with each
exercise cell's functions replaced by their solutions from notebooks/exercises/solutions/<notebook>.py,
where every one must pass. Neither run may leave minivit changed (the check cells restore what they
replace). The committed notebooks must read like the lessons, and the solutions must not be in them.
"""

import ast
import json
import re
from pathlib import Path

import pytest

from minivit import check, kernels
from minivit import functional as F
from minivit import layers as L
from minivit import optim

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = ROOT / "notebooks" / "exercises"
NOTEBOOKS = sorted(p.name for p in EXERCISES.glob("[0-9][0-9]_*.ipynb"))
STUB_MARK = "# your code here"


def _read(name):
    with open(EXERCISES / name, encoding="utf-8") as f:
        return json.load(f)


def _source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _tags(cell):
    return cell.get("metadata", {}).get("tags", [])


def _functions(source):
    """{name: source} of the top-level functions defined in source."""
    tree = ast.parse(source)
    return {node.name: ast.get_source_segment(source, node) for node in tree.body if isinstance(node, ast.FunctionDef)}


def _solutions(name):
    return _functions((EXERCISES / "solutions" / (Path(name).stem + ".py")).read_text(encoding="utf-8"))


def _state():
    """What a notebook must leave as it found it: every attribute of the modules and layer classes it may replace."""
    owners = [F, L, kernels, check, optim] + [c for c in vars(L).values() if isinstance(c, type)]
    return {id(o): dict(vars(o)) for o in owners}


def _run(name, solved, monkeypatch, planted=None):
    """Exec the notebook's code cells in order; return [(cell index, report)] for its check cells.
    planted: {function name: source}, put in place of the solution of that name (a planted bug)."""
    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    monkeypatch.setenv("MINIVIT_QUICK", "1")
    monkeypatch.chdir(EXERCISES)
    solutions = {**_solutions(name), **(planted or {})} if solved else {}
    namespace, reports = {"__name__": "__main__"}, []
    for i, cell in enumerate(_read(name)["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = _source(cell)
        if solved and "exercise" in _tags(cell):
            source = "\n\n".join(solutions[fn] for fn in _functions(source))
        if "check" in _tags(cell):
            namespace.pop("report", None)                     # each check cell must make its own
        exec(compile(source, f"{name}, cell {i}", "exec"), namespace)
        if "check" in _tags(cell):
            reports.append((i, namespace["report"]))
    plt.close("all")
    return reports


def test_there_are_exercises_for_every_backward_the_issue_asks_for():
    written = {fn for name in NOTEBOOKS for fn in _solutions(name)}
    assert {"patch2im", "linear_backward", "layernorm_backward", "gelu_backward", "softmax_backward",
            "attention_backward", "block_backward", "cross_entropy_backward", "adamw_update",
            "contrastive_loss_backward", "l2_normalize_backward", "reduce_scatter", "all_gather",
            "attention_entropy", "update_ratio", "drop_path_forward", "drop_path_backward",
            "hard_distillation_backward", "kl_distillation_backward", "random_masking_backward",
            "masked_mse_backward"} <= written, written


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_exercise_cell_is_a_stub_with_a_solution_and_a_check_after_it(name):
    cells = [c for c in _read(name)["cells"] if c["cell_type"] == "code"]
    solutions = _solutions(name)
    exercises = [i for i, c in enumerate(cells) if "exercise" in _tags(c)]
    assert exercises, f"{name} has no cell tagged 'exercise'"
    for i in exercises:
        source = _source(cells[i])
        assert STUB_MARK in source, f"{name}: exercise cell {i} has no '{STUB_MARK}' stub"
        assert _functions(source) and set(_functions(source)) <= set(solutions), \
            f"{name}: cell {i} defines {list(_functions(source))}, the solutions file {list(solutions)}"
        assert "check" in _tags(cells[i + 1]), f"{name}: the cell after exercise cell {i} must check it"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_solutions_are_not_in_the_notebook(name):
    code = [c for c in _read(name)["cells"] if c["cell_type"] == "code"]
    cells = [_source(c) for c in code]
    stubs = "\n".join(_source(c) for c in code if "exercise" in _tags(c))
    for fn, source in _solutions(name).items():
        for line in source.splitlines()[1:]:
            line = line.split("#")[0].strip()
            if len(line) > 12 and line not in stubs and not line.startswith(('"""', "return np.zeros")):
                assert not any(line in cell for cell in cells), f"{name}: the solution line {line!r} is in the notebook"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_with_the_stubs_every_check_says_wrong(name, monkeypatch):
    before = _state()
    reports = _run(name, solved=False, monkeypatch=monkeypatch)
    assert reports, f"{name} has no check cell"
    for i, report in reports:
        assert not report.ok, f"{name}, cell {i}: the stub passes its check:\n{report}"
        verdict = report.verdict()
        assert verdict.startswith("WRONG")
        # what a notebook user can act on: no command-line flag, and each wrong gradient told once
        assert not re.search(r"(?<![\w-])--[a-z]", verdict), f"{name}, cell {i} names a command-line flag:\n{verdict}"
        told = [(r.op, r.what.split()[0]) for r in report.wrong() if r.what.startswith("d")]
        assert len(told) == len(set(told)), f"{name}, cell {i} tells a wrong gradient twice:\n{verdict}"
    assert _state() == before, f"{name} left minivit changed (a replaced function not restored)"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_with_the_solutions_every_check_says_right(name, monkeypatch):
    before = _state()
    for i, report in _run(name, solved=True, monkeypatch=monkeypatch):
        assert report.ok, f"{name}, cell {i}: the solution fails its check:\n{report.table(verbose=True)}"
        assert report.verdict().startswith("RIGHT")
    assert _state() == before, f"{name} left minivit changed (a replaced function not restored)"


# Bugs a student makes, planted in place of one solution: the check of that function must say WRONG and name it
PLANTED = {
    "13_contrastive_loss.ipynb": [
        ("contrastive_loss_backward", "rows only", """
def contrastive_loss_backward(logits):
    B = logits.shape[0]
    e = np.exp(logits - logits.max(1, keepdims=True))
    return (e / e.sum(1, keepdims=True) - np.eye(B)) / B
""", "contrastive_loss dlogits"),
        ("l2_normalize_backward", "the radial part kept", """
def l2_normalize_backward(dout, cache):
    y, norm, eps = cache
    return dout / norm
""", "part along y"),
    ],
    "19_random_masking.ipynb": [
        ("random_masking_backward", "scattered with ids_restore", """
def random_masking_backward(dx_masked, cache):
    ids_keep, N = cache
    B, L, D = dx_masked.shape
    dx = np.zeros((B, N, D))
    dx[np.arange(B)[:, None], np.argsort(np.argsort(ids_keep, axis=1), axis=1)] = dx_masked
    return dx
""", "not zero on removed patches"),
        ("masked_mse_backward", "the mean over every patch", """
def masked_mse_backward(cache):
    diff, mask = cache
    return 2 * diff / diff.shape[-1] * (mask / mask.size)[..., None]
""", "x0.75"),
    ],
    "18_distillation_loss.ipynb": [
        ("hard_distillation_backward", "the dist head on the labels", """
def hard_distillation_backward(logits, logits_dist, labels, teacher_logits):
    B = logits.shape[0]

    def ce_grad(z, y):
        e = np.exp(z - z.max(1, keepdims=True))
        p = e / e.sum(1, keepdims=True)
        p[np.arange(B), y] -= 1.0
        return p / B

    return 0.5 * ce_grad(logits, labels), 0.5 * ce_grad(logits_dist, labels)
""", "the distillation head learns the teacher's argmax"),
        ("kl_distillation_backward", "the chain rule's 1/tau forgotten", """
def kl_distillation_backward(logits_dist, teacher_logits, tau):
    B = logits_dist.shape[0]

    def softmax(z):
        e = np.exp(z - z.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    return tau * tau * (softmax(logits_dist / tau) - softmax(teacher_logits / tau)) / B
""", "tau"),
    ],
    "14_ring_allreduce.ipynb": [
        ("reduce_scatter", "sends to the left", """
def reduce_scatter(chunks, send):
    R = len(chunks)
    for s in range(R - 1):
        for r in range(R):
            c = (r - s) % R
            chunks[(r - 1) % R][c] += send(r, (r - 1) % R, c)
""", "messages go to the right-hand neighbour"),
        ("all_gather", "adds instead of copying", """
def all_gather(chunks, send):
    R = len(chunks)
    for s in range(R - 1):
        for r in range(R):
            c = (r + 1 - s) % R
            chunks[(r + 1) % R][c] += send(r, (r + 1) % R, c)
""", "not the sum over the ranks"),
    ],
    "15_training_statistics.ipynb": [
        ("attention_entropy", "not divided by ln N", """
def attention_entropy(a):
    return float(-(a * np.log(np.maximum(a, 1e-30))).sum(-1).mean())
""", "(= ln N)"),
        ("update_ratio", "the difference of the norms", """
def update_ratio(before, after):
    size = np.linalg.norm(before)
    return None if size == 0 else float(abs(np.linalg.norm(after) - size) / size)
""", "the difference of the norms"),
    ],
    "16_drop_path.ipynb": [
        ("drop_path_forward", "a mask per value", """
def drop_path_forward(self, x):
    if not self.training or self.p == 0.0:
        self.cache = None
        return x
    self.cache = ((self.rng.random(x.shape) >= self.p) / (1.0 - self.p)).astype(x.dtype)
    return x * self.cache
""", "zeros inside a sample"),
        ("drop_path_backward", "without 1/(1-p)", """
def drop_path_backward(self, dout):
    if self.p == 0.0 or not self.training:
        return dout
    return dout * (self.cache != 0)
""", "x0.75 (= 1 - p)"),
    ],
}


@pytest.mark.parametrize("name, fn, bug, source, named",
                         [(name, *case) for name, cases in PLANTED.items() for case in cases],
                         ids=[f"{name[:2]}-{case[1]}" for name, cases in PLANTED.items() for case in cases])
def test_a_planted_bug_is_named_by_its_check(name, fn, bug, source, named, monkeypatch):
    reports = _run(name, solved=True, monkeypatch=monkeypatch, planted={fn: source.strip()})
    wrong = [report for _, report in reports if not report.ok]
    assert len(wrong) == 1, f"{name}, {bug}: {len(wrong)} checks fail, expected the one of {fn}"
    verdict = wrong[0].verdict()
    assert verdict.startswith("WRONG") and named in verdict, f"{name}, {bug}: the check says\n{verdict}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_exercise_reads_like_a_lesson(name):
    nb = _read(name)
    assert (EXERCISES / name).stat().st_size < 500_000, f"{name}: keep committed notebooks under 500 KB"
    cells = nb["cells"]
    assert cells[0]["cell_type"] == "markdown" and "What you will learn" in _source(cells[0])
    assert "What to try next" in _source(cells[-1])
    code = [c for c in cells if c["cell_type"] == "code"]
    assert 'os.environ.get("MINIVIT_QUICK") == "1"' in _source(code[0])
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{name}: commit the outputs of one run, top to bottom ({counts})"
    assert not any(o["output_type"] == "error" for c in code for o in c["outputs"]), f"{name} shows an error"
    assert any("image/png" in o.get("data", {}) for c in code for o in c["outputs"]), f"{name} has no figure"
    checks = [c for c in code if "check" in _tags(c)]
    shown = ["".join(o.get("text", "")) for c in checks for o in c["outputs"] if o["output_type"] == "stream"]
    assert all(text.startswith("WRONG") for text in shown) and len(shown) == len(checks), \
        f"{name}: the committed outputs must be the stubs' (WRONG), what a student sees first"


def test_the_index_explains_the_exercises():
    index = (ROOT / "notebooks" / "README.md").read_text(encoding="utf-8")
    assert "exercises/" in index and "solutions/" in index
    for name in NOTEBOOKS:
        assert name in index, f"notebooks/README.md does not list exercises/{name}"
