"""The running IPython shell, if any (its history, its user namespace)."""

from __future__ import annotations

import sys
from typing import Any


def ipython_shell() -> Any:
    """The running IPython shell, or None (plain Python)."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()
