"""The notebooks run from top to bottom (their code cells in order, headless), and their own
invariant checks hold."""

from __future__ import annotations

import json
import os

import matplotlib
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_notebook(name: str) -> dict:
    """Execute the code cells of ``notebooks/name`` in one namespace, from the notebooks
    folder, with a non-interactive matplotlib backend; returns the namespace."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(os.path.join(ROOT, "notebooks", name)) as f:
        cells = json.load(f)["cells"]
    ns = {"__name__": "__main__"}
    cwd = os.getcwd()
    os.chdir(os.path.join(ROOT, "notebooks"))
    try:
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                exec(compile("".join(cell["source"]), f"{name} cell {i}", "exec"), ns)
                plt.close("all")
    finally:
        os.chdir(cwd)
    return ns


def test_csa2_modes_notebook():
    """csa2_modes.ipynb: the layer plan has every mode, the per-layer top-k invariants it
    asserts hold over every query, the overlap matrix is a symmetric Jaccard matrix with a unit
    diagonal, and the release config's global KV is 890 bytes per token."""
    ns = run_notebook("csa2_modes.ipynb")
    assert {r.mode for r in ns["plan"].roles} == {"swa", "full", "reindex", "reuse"}
    jac = ns["jac"]
    assert jac.shape == (3, 3) and np.allclose(jac, jac.T) and np.allclose(np.diag(jac), 1)
    assert ((jac >= 0) & (jac <= 1)).all() and jac[0, 1] < 1
    assert ns["per_token"]["flash.json (release)"] == 890
