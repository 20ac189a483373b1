"""python -m minivit.check [NAME ...]: the one command to run after you edit a layer.

For each op (or only the named ones) it checks, on small random inputs:
  forward    the layer class as it stands against the functional pairs composed by hand (float64), and
             the functional pair against its fast kernel in minivit/fast/kernels.py where there is one: an
             independent second implementation, float32, so compared on float32 copies at float32 tolerance;
  gradients  every input and parameter gradient against central differences (minivit.gradcheck, float64);
and prints a table (op, what was compared, relative error, ok / WRONG), exiting 1 on any WRONG. A WRONG row
says which tensor, and where a simple diagnosis fits, what is wrong with it: off by a constant factor
("x0.5"), the wrong sign, two heads swapped or axes transposed, an error that is the same along the
normalised axis (a missing mean term), zero where it should not be, one sample's gradient where the sum
over the batch belongs.

Everything is looked up when the check runs: the functions on their modules (an edited or monkeypatched
functional.layernorm_backward is what is checked) and the layers built from their classes as they stand
(an edited layers.Block.backward too). From Python or a notebook:

    from minivit import check
    report = check.run(["layernorm", "attention"])
    print(report); report.ok; report.wrong()          # rows: .op, .what, .error, .note, .got, .expected
    with check.replaced(F, "gelu_backward", my_gelu_backward):   # yours in place of minivit's, then restored
        print(check.run(["gelu"]).verdict())

The model walk (run with no NAME, with --clip, with --model FILE.py:FUNC, or check.run_model(model)) checks
a model as its classes stand, so a layer minivit.check has never seen needs no reference: one float64 forward in
training mode records each layer's input (its forward wrapped, then restored), and every layer is checked
on its own input by central differences, children before parents (depth first, post-order). A layer called
with more than its input (an attention mask) is checked with the rest held fixed; one whose backward
returns several gradients (CLIP's similarity) is "not checked: takes N inputs". Rows are named by the
layer's path ("blocks.1.attn") and the tensor ("dgamma"; "blocks.1.gamma" in the summary). A layer with a
WRONG layer inside is "skipped: fix <path> first"; one whose layers are right but which is wrong is WRONG
under its own path. The textbook compositions in compare.py (_layernorm, _attention, _block ...) serve diagnosis
only: a layer of their class that no longer computes them is "differs" ("forward differs from the textbook
<op>: checked by numerical gradients only"), never WRONG.

    report = check.run_model(model)                   # a copy of model, float64; x: a batch of 3 images
"""

# The rooms: report.py (rows, the table, the diagnoses), compare.py (the comparisons every op is made of, the
# textbook forwards), ops.py (one check per op, OPS, run), walk.py (the model walk, run_model),
# overfit.py (a tiny ViT on one batch), command.py (python -m minivit.check).
from .command import main
from .compare import TOKENS
from .ops import COMPOSITE, OPS, run, select
from .overfit import Losses, overfit
from .report import DIFFERS, FIT, TOL_GRAD, TOL_KERNEL, TOL_SAME, Report, Row, diagnose, replaced
from .walk import _default_model  # noqa: F401  (the command's default model; tests build it)
from .walk import default_input, load_model, run_model, walk_rows

__all__ = ["COMPOSITE", "DIFFERS", "FIT", "OPS", "TOKENS", "TOL_GRAD", "TOL_KERNEL", "TOL_SAME", "Losses", "Report",
           "Row", "default_input", "diagnose", "load_model", "main", "overfit", "replaced", "run", "run_model",
           "select", "walk_rows"]
