import sys
from pathlib import Path

CHAPTER = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(CHAPTER), str(CHAPTER.parents[1])]  # this chapter's modules, then common/
