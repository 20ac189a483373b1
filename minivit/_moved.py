"""Modules that moved into a subpackage keep their old import path.

``import minivit.kernels`` or ``from minivit.ops import ...`` in code written before a move still works: the
old dotted name is an alias of the module at its new place (the same module object, so a setting made through
one name is seen through the other). MOVED lists every such name, old -> new; the finder below is installed
when this module is imported, which `import minivit` does first.
"""

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {   # "minivit.<old>" -> "minivit.<sub>.<new>"
    "minivit.amp": "minivit.fast.amp",
    "minivit.augment": "minivit.data.augment",
    "minivit.captions": "minivit.clip.captions",
    "minivit.download": "minivit.data.download",
    "minivit.kernels": "minivit.fast.kernels",   # its names that moved on to fast.cpu, .cuda, .attention too
    "minivit.ops": "minivit.fast.ops",
    "minivit.ops_report": "minivit.fast.report",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of MOVED and hands back the module at its new place."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])   # the moved module itself, not a copy

    def exec_module(self, module):
        pass                                               # already run under its new name


def install():
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())


def old_names():
    """The moved modules' old attribute names on the package: "kernels" for "minivit.kernels"."""
    return sorted(name.split(".", 1)[1] for name in MOVED if name.count(".") == 1)


install()
