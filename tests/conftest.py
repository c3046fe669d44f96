"""Repo-wide tests import `common` as an installed package (pyproject.toml; `make setup` installs
it editable) and chapters through common.chapters."""

from common.testing import pytest_configure  # noqa: F401  (parallel workers share the cores)
