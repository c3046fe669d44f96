"""Repo-wide tests import `common` as an installed package (pyproject.toml; `make setup` installs
it editable) and chapters through common.tools.chapters."""

import pytest

from common.tools.testing import (  # noqa: F401  (shared cores; seeded draws; devices used)
    pytest_configure,
    pytest_runtest_setup,
    pytest_terminal_summary,
)

# Imported as a child interpreter starts (its folder first on PYTHONPATH): every import of a
# hidden package fails as it would where the package was never installed.
NOT_INSTALLED = """
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, NotInstalled())
"""


@pytest.fixture
def hiding(tmp_path):
    """hiding(*packages) -> a PYTHONPATH under which a child Python cannot import those packages."""

    def folder(*packages: str) -> str:
        (tmp_path / "sitecustomize.py").write_text(NOT_INSTALLED.format(hidden=packages))
        return str(tmp_path)

    return folder
