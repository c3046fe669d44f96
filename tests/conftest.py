"""Repo-wide tests import `common` as an installed package (pyproject.toml; `make setup` installs
it editable) and chapters through common.chapters. Nothing to set up here."""
