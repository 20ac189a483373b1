"""Execute lessons top to bottom and save them with their outputs: how the committed notebooks are made.

    python scripts/execute_notebook.py notebooks/10_exercises.ipynb            # full mode
    python scripts/execute_notebook.py --quick notebooks/15_*.ipynb            # quick mode
    MINIVIT_QUICK=1 python scripts/execute_notebook.py notebooks/15_*.ipynb    # quick mode too

The mode is quick with --quick or with MINIVIT_QUICK=1 in the environment (as `MINIVIT_QUICK=1 make lab`),
full otherwise; --full forces full mode whatever the environment says. The script prints the mode, and why,
before it runs each notebook. Each notebook runs in its own folder (so `assets/...` and `runs/...` resolve as
in Jupyter), with the same environment as tests/test_notebooks.py: MINIVIT_BACKEND=numpy,
OPENBLAS_NUM_THREADS=1, MINIVIT_CHECK_CLAIMS=1 and this checkout first on PYTHONPATH (the kernel gets them;
this process's environment is left as it is). The executed notebook replaces the file only after every cell
ran without an error (written to a temporary file, then os.replace). Progress bars are saved as a terminal
shows them, their last state before each printed line (collapse_progress). Each notebook says in its first cell
which mode its committed outputs come from; notebooks/README.md lists them.
"""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def choose_mode(quick_flag, full_flag, environ):
    """(quick, why): the mode asked for on the command line, else the one MINIVIT_QUICK gives, else full."""
    if quick_flag:
        return True, "--quick"
    if full_flag:
        return False, "--full"
    if environ.get("MINIVIT_QUICK") == "1":
        return True, "MINIVIT_QUICK=1 in the environment"
    return False, "the default: MINIVIT_QUICK is not 1 and neither --quick nor --full was given"


def kernel_env(quick, environ=os.environ):
    """The environment the notebook's kernel runs in: the test suite's, with MINIVIT_QUICK set or unset."""
    env = dict(environ)
    env["MINIVIT_BACKEND"] = "numpy"
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["MINIVIT_CHECK_CLAIMS"] = "1"          # notebooks/claims.py: a claim the run does not show stops it
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
    if quick:
        env["MINIVIT_QUICK"] = "1"
    else:
        env.pop("MINIVIT_QUICK", None)
    return env


def terminal_text(text):
    """What a terminal shows of text: each line only after its last carriage return. A progress bar (tqdm)
    redraws its line with \\r at every step; kept whole, a 1,400-step run would write 1,400 copies of it into
    the notebook. A part of only spaces (tqdm blanking its line) hides nothing: the part before it is shown."""
    lines = []
    for line in text.split("\n"):
        shown = [part for part in line.split("\r") if part.strip()]
        lines.append(shown[-1] if shown else "")
    return "\n".join(lines)


def collapse_progress(outputs):
    """A cell's outputs with each run of consecutive stream outputs of one name (stdout or stderr) merged into
    one and reduced to terminal_text; the order of stdout and stderr and every other output are kept."""
    merged = []
    for out in outputs:
        if out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream" \
                and merged[-1].get("name") == out.get("name"):
            merged[-1]["text"] += out["text"]
        else:
            merged.append(out)
    for out in merged:
        if out.get("output_type") == "stream":
            out["text"] = terminal_text(out["text"])
    return merged


def execute(path, quick, timeout=1800):
    import nbclient
    import nbformat

    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:                       # from a clean slate
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute(env=kernel_env(quick))       # raises CellExecutionError on the first failing cell
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = collapse_progress(cell.outputs)   # progress bars as a terminal shows them
    tmp = path.with_name(f".{path.name}.tmp")
    nbformat.write(nb, tmp)
    os.replace(tmp, path)
    return time.perf_counter() - start


def main(argv=None, environ=os.environ):
    parser = argparse.ArgumentParser(description="Execute lessons in place, saving their outputs.")
    parser.add_argument("notebooks", nargs="+", help="the .ipynb files")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="quick mode (MINIVIT_QUICK=1 in the environment too)")
    mode.add_argument("--full", action="store_true", help="full mode, even with MINIVIT_QUICK=1 in the environment")
    args = parser.parse_args(argv)
    for name in args.notebooks:
        if not name.endswith(".ipynb") or not os.path.isfile(name):
            parser.error(f"not a notebook file: {name!r}")
    quick, why = choose_mode(args.quick, args.full, environ)
    label = "quick" if quick else "full"
    for name in args.notebooks:
        print(f"{name}: running in {label} mode ({why}) ...", flush=True)
        seconds = execute(name, quick)
        print(f"{name}: {label} mode, {seconds:.0f} s, saved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
