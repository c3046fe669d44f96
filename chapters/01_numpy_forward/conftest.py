"""pytest setup for this chapter's tests.

The chapter's modules import each other by plain name (`import model`), as they do when one of
its scripts runs (Python puts a script's folder first on sys.path). The tests get the same view:
this folder first on sys.path. `common` needs nothing: it is an installed package (pyproject.toml).
"""

import sys
from pathlib import Path

CHAPTER = Path(__file__).resolve().parent
sys.path.insert(0, str(CHAPTER))
