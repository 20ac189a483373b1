"""What a lesson's prose says, checked against the run printed beside it.

A lesson that tells you "drop-path helps, dropout does not" computes both in the cell above the sentence and
says, through `claim`, whether this run shows it:

    from claims import claim
    claim("drop-path beats the baseline", drop_path_mean > base_mean,
          f"{drop_path_mean:.1f}% against {base_mean:.1f}%")

prints

    shown: drop-path beats the baseline (55.3% against 52.1%)

or, when your run (another machine, your edit, another seed) does not show it,

    NOT SHOWN by this run: drop-path beats the baseline (51.0% against 52.1%)

so that the prose never says more than the outputs beside it. A claim that only full mode's longer runs can
show is marked `full_only=True`: quick mode prints what it saw without holding the prose to it.

The test suite and scripts/execute_notebook.py run the lessons with MINIVIT_CHECK_CLAIMS=1: then a claim
not shown stops the lesson with an error, so a lesson whose outputs stop backing its prose cannot be
committed or pass CI unnoticed. In Jupyter nothing stops: you read the line and decide.
"""

import os

SHOWN = []          # (text, holds, figures) of every claim this kernel made, in order


def quick_mode():
    """True when the lesson runs in quick mode (MINIVIT_QUICK=1), as every lesson's first cell reads it."""
    return os.environ.get("MINIVIT_QUICK") == "1"


def claim(text, holds, figures="", *, full_only=False):
    """Say whether this run shows `text`; holds: the comparison computed from the outputs (a bool);
    figures: the numbers it rests on, printed after the text. Returns holds."""
    if not isinstance(text, str) or not text:
        raise TypeError(f"claim's text must be a non-empty string, got {text!r}")
    holds = bool(holds)
    detail = f" ({figures})" if figures else ""
    SHOWN.append((text, holds, figures))
    if holds:
        print(f"shown: {text}{detail}")
        return True
    if full_only and quick_mode():
        print(f"not shown by this quick run (stated for full mode): {text}{detail}")
        return False
    print(f"NOT SHOWN by this run: {text}{detail}")
    if os.environ.get("MINIVIT_CHECK_CLAIMS") == "1":
        raise AssertionError(f"the lesson says '{text}', but its own run does not show it{detail}")
    return False
