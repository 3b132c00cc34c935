"""``nki.collectives``: documented, not implemented by the interpreter.

Every documented name (``all_reduce``, ``all_gather``, ``collective_permute``, ...) is a placeholder
that raises ``NotImplementedError`` naming the API when used (see :mod:`trnkit.nkisim.api_names`).
"""

from .api_names import fill_missing

fill_missing(globals(), "nki.collectives")
