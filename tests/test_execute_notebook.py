"""scripts/execute_notebook.py: the mode it runs a lesson in is the one asked for, and it says which."""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("execute_notebook", ROOT / "scripts" / "execute_notebook.py")
execute_notebook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute_notebook)


@pytest.mark.parametrize("quick_flag, full_flag, environ, quick", [
    (False, False, {}, False),
    (False, False, {"MINIVIT_QUICK": "1"}, True),      # `MINIVIT_QUICK=1 python scripts/execute_notebook.py ...`
    (False, False, {"MINIVIT_QUICK": "0"}, False),
    (True, False, {}, True),
    (False, True, {"MINIVIT_QUICK": "1"}, False),      # --full wins over the environment
])
def test_the_mode_comes_from_the_flags_then_the_environment(quick_flag, full_flag, environ, quick):
    assert execute_notebook.choose_mode(quick_flag, full_flag, environ)[0] is quick


def test_the_kernel_gets_the_mode_and_the_test_suites_environment_and_the_caller_keeps_its_own():
    caller = {"MINIVIT_QUICK": "1", "PYTHONPATH": "elsewhere", "HOME": "/home/someone"}
    full = execute_notebook.kernel_env(False, caller)
    assert "MINIVIT_QUICK" not in full and full["HOME"] == "/home/someone"
    assert full["MINIVIT_BACKEND"] == "numpy" and full["OPENBLAS_NUM_THREADS"] == "1"
    assert full["PYTHONPATH"] == str(ROOT) + os.pathsep + "elsewhere"
    assert execute_notebook.kernel_env(True, {})["MINIVIT_QUICK"] == "1"
    assert caller == {"MINIVIT_QUICK": "1", "PYTHONPATH": "elsewhere", "HOME": "/home/someone"}


def _tiny_notebook(path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        'import os\nprint("MINIVIT_QUICK =", os.environ.get("MINIVIT_QUICK"))')])
    nbformat.write(nb, path)
    return nbformat


def test_minivit_quick_in_the_environment_runs_the_notebook_in_quick_mode(tmp_path, monkeypatch, capsys):
    path = tmp_path / "lesson.ipynb"
    nbformat = _tiny_notebook(path)
    monkeypatch.setenv("MINIVIT_QUICK", "1")
    assert execute_notebook.main([str(path)]) == 0
    printed = capsys.readouterr().out
    assert "running in quick mode (MINIVIT_QUICK=1 in the environment)" in printed, printed
    (out,) = nbformat.read(path, as_version=4).cells[0].outputs
    assert out["text"] == "MINIVIT_QUICK = 1\n"
    assert os.environ["MINIVIT_QUICK"] == "1"                   # this process's environment is left as it was

    assert execute_notebook.main(["--full", str(path)]) == 0
    assert "running in full mode (--full)" in capsys.readouterr().out
    (out,) = nbformat.read(path, as_version=4).cells[0].outputs
    assert out["text"] == "MINIVIT_QUICK = None\n"


def test_a_progress_bar_is_saved_as_a_terminal_shows_it():
    assert execute_notebook.terminal_text("step 1\rstep 2\rstep 3") == "step 3"
    assert execute_notebook.terminal_text("a\rb\nc\rd\n") == "b\nd\n"
    assert execute_notebook.terminal_text("bar 100%\r      \r") == "bar 100%"     # tqdm blanking its line
    assert execute_notebook.terminal_text("plain\n  indented\n") == "plain\n  indented\n"
    outputs = [{"output_type": "stream", "name": "stderr", "text": "\r 10%"},
               {"output_type": "stream", "name": "stderr", "text": "\r 20%"},
               {"output_type": "stream", "name": "stdout", "text": "eval at 20%\n"},
               {"output_type": "stream", "name": "stderr", "text": "\r 30%"},
               {"output_type": "display_data", "data": {"text/plain": "a figure"}},
               {"output_type": "stream", "name": "stderr", "text": "\r100%\n"}]
    assert execute_notebook.collapse_progress(outputs) == [
        {"output_type": "stream", "name": "stderr", "text": " 20%"},
        {"output_type": "stream", "name": "stdout", "text": "eval at 20%\n"},
        {"output_type": "stream", "name": "stderr", "text": " 30%"},
        {"output_type": "display_data", "data": {"text/plain": "a figure"}},
        {"output_type": "stream", "name": "stderr", "text": "100%\n"}]


def test_an_executed_notebook_keeps_one_line_of_a_redrawn_progress_bar(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    path = tmp_path / "lesson.ipynb"
    source = ("import sys, time\n"
              "for i in range(1, 401):\n"
              "    sys.stderr.write(f'\\rstep {i}/400'); sys.stderr.flush()\n"
              "    if i % 200 == 0:\n"
              "        time.sleep(0.3); print(f'evaluated at step {i}', flush=True); time.sleep(0.3)\n"
              "_ = sys.stderr.write('\\n')")
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), path)
    assert execute_notebook.main(["--quick", str(path)]) == 0
    outputs = nbformat.read(path, as_version=4).cells[0].outputs
    text = "".join(o["text"] for o in outputs)
    assert "\r" not in text and text.count("step ") == 4, text     # two bars and two evaluation lines
    assert [o["text"] for o in outputs if o["name"] == "stdout"] == ["evaluated at step 200\n",
                                                                     "evaluated at step 400\n"]
    assert "step 400/400" in text
