"""The command line of minivit.check: `python -m minivit.check [NAME ...] [--model FILE.py:FUNC] [--clip]
[--no-kernels] [-v]`, which checks the ops, then walks the whole model."""

import argparse

from .ops import OPS, run, select
from .walk import _default_model, load_model, run_model


def main(argv=None):
    listing = "\n".join(f"  {name:<14} {what}" for name, (_, what) in OPS.items())
    parser = argparse.ArgumentParser(
        prog="python -m minivit.check", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check each layer op after an edit: its forward against the functional pairs (and the fast "
                    "kernels), every gradient against central differences. Prints a table; exits 1 on any WRONG.",
        epilog=f"ops (default: all; 'gelu' selects gelu_erf and gelu_tanh):\n{listing}")
    parser.add_argument("names", nargs="*", metavar="NAME", help="ops to check (default: all)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every gradient row of the composite ops")
    parser.add_argument("--no-kernels", action="store_true",
                        help="leave out the comparison with minivit/fast/kernels.py "
                             "(when you changed the math on purpose)")
    parser.add_argument("--model", metavar="FILE.py:FUNC",
                        help="check every layer of the model FUNC() builds (FUNC(dtype='float64') if it takes dtype), "
                             "instead of the ops")
    parser.add_argument("--clip", action="store_true", help="walk a tiny CLIP's layers instead of the ViT's")
    args = parser.parse_args(argv)
    if args.model:
        try:
            model = load_model(args.model)
        except ValueError as err:
            parser.error(str(err))
        report = run_model(model)
        print(report.table(verbose=args.verbose))
        return 0 if report.ok else 1
    try:
        names = select(args.names)
    except ValueError as err:
        parser.error(str(err))
    reports = []
    if not args.clip:
        reports.append(run(names, use_kernels=not args.no_kernels))
        print(reports[-1].table(verbose=args.verbose))
    if not args.names:                              # the whole model, layer by layer, as its classes stand
        model = _default_model(clip=args.clip)
        print(f"\nevery layer of the {type(model).__name__} ({model.num_params()} parameters), each on its own input:")
        reports.append(run_model(model))
        print(reports[-1].table(verbose=args.verbose))
    return 0 if all(r.ok for r in reports) else 1
