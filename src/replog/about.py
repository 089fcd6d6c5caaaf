"""What the package is: its name, its version and where it is installed.

DESIGN: the bottom floor's answer for any layer that needs the package itself (the CLI's
``--version``, the Spark layer pickling replog's modules by value), so that none of them
imports the package's face, ``replog/__init__.py``, which imports them all.
"""

from __future__ import annotations

import os

__version__ = "0.5.0"
"""The release (the wheel's version is read from here)."""
PACKAGE = __name__.rpartition(".")[0]
"""The package's import name: ``replog``."""
PACKAGE_DIR = os.path.dirname(__file__)
"""The folder of the package's modules (``replog.__path__``)."""
