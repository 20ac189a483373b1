"""The paper's variants and ablations, in miniature: `python -m experiments.<name> --quick` (see README.md)."""
