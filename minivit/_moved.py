"""Modules that moved into a subpackage keep their old import path.

``import minivit.kernels`` or ``from minivit.ops import ...`` in code written before a move still works: the
old dotted name is an alias of the module at its new place (the same module object, so a setting made through
one name is seen through the other), and ``python -m minivit.<old>`` runs the command at its new place.
MOVED lists every such name, old -> new; the finder below is installed when this module is imported, which
`import minivit` does first.
"""

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {   # "minivit.<old>" -> "minivit.<sub>.<new>"
    "minivit.amp": "minivit.fast.amp",
    "minivit.augment": "minivit.data.augment",
    "minivit.captions": "minivit.clip.captions",
    "minivit.checkpoint": "minivit.weights.checkpoint",
    "minivit.clip_train": "minivit.clip.task",
    "minivit.convert": "minivit.weights.convert",
    "minivit.download": "minivit.data.download",
    "minivit.hf": "minivit.weights.hf",
    "minivit.kernels": "minivit.fast.kernels",   # its names that moved on to fast.cpu, .cuda, .attention too
    "minivit.ops": "minivit.fast.ops",
    "minivit.ops_report": "minivit.fast.report",
    "minivit.plot": "minivit.train.plot",        # python -m minivit.plot runs it (get_code below)
    "minivit.stats": "minivit.train.stats",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of MOVED and hands back the module at its new place."""

    def __init__(self):
        self.real_specs = {}                               # new name -> the module's own spec

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])   # the moved module itself, not a copy
        self.real_specs[module.__name__] = module.__spec__    # the import system sets the old name's spec on it
        return module

    def exec_module(self, module):
        module.__spec__ = self.real_specs[module.__name__]   # already run under its new name: keep its own spec

    def get_code(self, fullname):
        """What ``python -m minivit.<old>`` runs (runpy asks the loader for code, not a module): the command of
        the module at its new place, its main(), imported there so that its relative imports resolve."""
        source = f"import sys\nfrom {MOVED[fullname]} import main\nsys.exit(main())\n"
        return compile(source, f"<{fullname}: moved to {MOVED[fullname]}>", "exec")

    def is_package(self, fullname):
        return False


def install():
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())


def old_names():
    """The moved modules' old attribute names on the package: "kernels" for "minivit.kernels"."""
    return sorted(name.split(".", 1)[1] for name in MOVED if name.count(".") == 1)


install()
