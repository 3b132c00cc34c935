"""trnkit's NKI kernels, one folder per family (``attention``, ``cross_entropy``, ``mlp``, ``moe``,
``rmsnorm``, ``rope``, ``router``).

A family's package is its host API (the entry points that check inputs, lay them out and launch the
kernels); beside it ``<family>_torch.py`` holds the torch references, ``constraints.py`` the declared
input constraints and the kernel modules the ``@nki.jit`` kernels. This package imports nothing, so
importing a family's constraints or references does not load the NKI backend.
"""
