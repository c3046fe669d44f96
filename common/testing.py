"""Helpers for chapter tests that compare one chapter with another."""

from __future__ import annotations

import types

import pytest

from common.chapters import ChapterNotFoundError, load_chapter


def load_neighbour(number: int, *module_names: str) -> types.SimpleNamespace:
    """load_chapter(), or a skip with the reason when chapter `number` is not there (a chapter
    copied out of the repository on its own): the comparison needs both chapters."""
    try:
        return load_chapter(number, *module_names)
    except ChapterNotFoundError as e:
        pytest.skip(f"compares with chapter {number:02d}, which is not here ({e})")
