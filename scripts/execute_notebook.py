"""Execute lessons top to bottom and save them with their outputs: how the committed notebooks are made.

    python scripts/execute_notebook.py notebooks/10_exercises.ipynb            # full mode
    python scripts/execute_notebook.py --quick notebooks/15_*.ipynb            # quick mode (MINIVIT_QUICK=1)

Each notebook runs in notebooks/ (so `assets/...` and `runs/...` resolve as in Jupyter), with the same
environment as tests/test_notebooks.py: MINIVIT_BACKEND=numpy, OPENBLAS_NUM_THREADS=1 and this checkout
first on PYTHONPATH. The executed notebook replaces the file only after every cell ran without an error
(written to a temporary file, then os.replace). Each notebook says in its first cell which mode its
committed outputs come from; notebooks/README.md lists them.
"""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def execute(path, quick, timeout=1800):
    import nbclient
    import nbformat

    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:                       # from a clean slate
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    os.environ["MINIVIT_BACKEND"] = "numpy"
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    if quick:
        os.environ["MINIVIT_QUICK"] = "1"
    else:
        os.environ.pop("MINIVIT_QUICK", None)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()                            # raises CellExecutionError on the first failing cell
    tmp = path.with_name(f".{path.name}.tmp")
    nbformat.write(nb, tmp)
    os.replace(tmp, path)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description="Execute lessons in place, saving their outputs.")
    parser.add_argument("notebooks", nargs="+", help="the .ipynb files")
    parser.add_argument("--quick", action="store_true", help="quick mode (MINIVIT_QUICK=1)")
    args = parser.parse_args(argv)
    for name in args.notebooks:
        if not name.endswith(".ipynb") or not os.path.isfile(name):
            parser.error(f"not a notebook file: {name!r}")
    for name in args.notebooks:
        seconds = execute(name, args.quick)
        print(f"{name}: {'quick' if args.quick else 'full'} mode, {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
