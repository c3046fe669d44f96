"""pytest setup for this chapter's tests.

The chapter's modules import each other by plain name (`import model`), as they do when one of
its scripts runs (Python puts a script's folder first on sys.path). The tests get the same view
from this file's presence alone: pytest (in its default "prepend" import mode) puts the folder of
a conftest.py that is not inside a package first on sys.path before importing it. `common` needs
nothing: it is an installed package (pyproject.toml).
"""

from common.tools.carried import pytest_collection_modifyitems  # noqa: F401  (carried tests skip where unchanged)
from common.tools.testing import pytest_configure, pytest_runtest_setup  # noqa: F401  (shared cores; seeded draws)
