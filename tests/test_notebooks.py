"""Every notebooks/*.ipynb executes top to bottom without an error.

Each notebook runs in a fresh Jupyter kernel ("python3", i.e. this interpreter) with the
notebooks/ folder as its working directory, as a reader opening it in Jupyter would. A new
chapter's notebook is picked up by the glob; there is nothing to register. A notebook whose
figures take long (04's perplexity table) runs here on a smaller slice: PARAMETERS below.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
# Smaller work for a notebook's cell tagged "parameters" (papermill's convention), run in a cell
# put right after it: the same code on a smaller slice, so the suite does not pay for the figures.
PARAMETERS = {
    "02_kv_cache.ipynb": "n_steps = 8",
    "04_quant.ipynb": "PPL_TOKENS, CONTEXT, STRIDE = 256, 128, 64\nPROMPT_TOKENS, NEW = 32, 8",
    "06_cuda_kernel.ipynb": "CONTEXTS, BATCHES = [128, 1024], [1, 16]",
    "07_speculative.ipynb": "DRAWS = 3_000",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _strip_ansi(text: str) -> str:
    # IPython colours its tracebacks; the escape codes only make a pytest report harder to read.
    return _ANSI.sub("", text)


def test_notebooks_exist():
    # An empty parametrization would only be reported as skipped; an empty folder is a bug.
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOKS_DIR}"


def _with_parameters(nb, name: str):
    """The notebook with PARAMETERS[name] in a new cell after its "parameters" cell."""
    if name not in PARAMETERS:
        return nb
    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{name}: PARAMETERS has values for it, but it has {len(tagged)} cells tagged 'parameters'"
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(PARAMETERS[name], metadata={"tags": ["injected"]}))
    return nb


def _skip_without_the_kernel_library(name: str) -> None:
    """A notebook about the kernel library needs it built: where it cannot be (no C++ compiler),
    the skip says why, as the notebook's first kernels.load() would."""
    import kernels

    try:
        kernels.load()
    except kernels.KernelBuildError as e:
        pytest.skip(f"{name} runs kernels/, which cannot be built here: {str(e).splitlines()[0]}")


def _failing_cell(nb) -> str:
    for index, cell in enumerate(nb.cells):
        if any(out.get("output_type") == "error" for out in cell.get("outputs", [])):
            first_line = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
            return f"cell {index} ({first_line!r})"
    return "a cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path: Path, monkeypatch):
    # The kernel is a child process and inherits this environment: keep it offline and quiet.
    # (It imports `common` as the installed package, like any notebook a reader opens.)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    nb = _with_parameters(nbformat.read(path, as_version=4), path.name)
    if any("kernels.load()" in cell.source for cell in nb.cells):
        _skip_without_the_kernel_library(path.name)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    failure = None
    try:
        client.execute()
    except CellExecutionError as e:
        failure = f"{_failing_cell(nb)} raised {e.ename}: {e.evalue}\n\n{_strip_ansi(str(e))}"
    except CellTimeoutError as e:
        failure = f"a cell ran longer than {CELL_TIMEOUT_S} s: {e}"
    except DeadKernelError as e:
        failure = f"the kernel died (out of memory, or a crash in native code): {e}"
    if failure:  # reported outside the except block, so the message is not followed by a chained traceback
        pytest.fail(f"{path.name}: {failure}", pytrace=False)


def test_a_notebook_of_the_kernel_library_skips_where_it_cannot_be_built(monkeypatch):
    import kernels

    def no_compiler():
        raise kernels.KernelBuildError("no C++ compiler: `c++` is not on PATH. Install one\n(more)")

    monkeypatch.setattr(kernels, "load", no_compiler)
    with pytest.raises(pytest.skip.Exception, match=r"06_cuda_kernel.ipynb runs kernels/, .*: no C\+\+ compiler: .*one$"):
        _skip_without_the_kernel_library("06_cuda_kernel.ipynb")
