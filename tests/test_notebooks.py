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
    """csa2_modes.ipynb on the demo checkpoint: the layer plan has every mode, the per-layer
    top-k invariants it asserts hold over every query, the overlap matrix is a symmetric
    Jaccard matrix with a unit diagonal, the release config's global KV is 890 bytes per
    token, and the trained-model measurements (selection overlap per layer, pool recall,
    attention mass, FP4 / FP8 KV error with and without selection changes, bounded-replay
    KL) are well-formed."""
    ns = run_notebook("csa2_modes.ipynb")
    assert {r.mode for r in ns["plan"].roles} == {"swa", "full", "reindex", "reuse"}
    jac = ns["jac"]
    n_src = len([r for r in ns["plan"].roles if r.mode in ("full", "reindex")])
    assert jac.shape == (n_src, n_src) and n_src >= 3
    assert np.allclose(jac, jac.T) and np.allclose(np.diag(jac), 1)
    assert ((jac >= 0) & (jac <= 1)).all() and jac[0, 1] < 1
    assert ns["per_token"]["flash.json (release)"] == 890
    # the trained-model measurements: one overlap per layer with global entries, every mode
    sel = ns["selection"]
    assert {m for _, m, _, _, _ in sel} == {"full", "reindex", "reuse"}
    assert all(0 < ov <= 1 for *_, ov in sel)
    assert all(d == 0 for _, m, _, d, _ in sel if m != "reuse")
    assert all(d > 0 for _, m, _, d, _ in sel if m == "reuse")
    assert all(0 <= v <= 1 for v in ns["pool_recall"].values())
    mass = ns["mass"]
    assert mass.shape == (ns["cfg"].n_layers, 3) and np.allclose(mass.sum(-1), 1, atol=1e-4)
    swa = [r.layer for r in ns["plan"].roles if r.mode == "swa"]
    assert np.all(mass[swa, 1] == 0)                 # SWA-only layers have no global entries
    # KV quantisation: the values' error with the same top-k (asserted in the notebook), then
    # the indexer's: SWA-only layers have neither main KV nor a selection
    kv = ns["kv_error"]
    assert sorted(kv) == list(range(ns["cfg"].n_layers))
    for r in ns["plan"].roles:
        e = kv[r.layer]
        assert 0 < e["+ FP8 window"][0] < 0.2
        if r.mode == "swa":
            assert e["FP4 main"][0] == 0 and e["adds"] == 0
            assert e["+ MXFP4 index q"][0] == e["+ FP8 window"][0]
        else:
            assert 0 < e["FP4 main"][0] and e["adds"] > 0
            assert 0 < e["+ MXFP4 index K"][1] < 1 and 0 < e["+ MXFP4 index q"][1] < 1
    assert sorted(ns["replay"]) == [1024, 2048, 4096, 8192]
    assert all(0 <= kl_mean <= kl_max < 1 for kl_mean, kl_max, _ in ns["replay"].values())


def test_state_tour_notebook():
    """state_tour.ipynb: the byte accounting adds up to the state's arrays, a prefill writes
    pos // r entries per source (asserted in the notebook), the prompt prefilled in two chunks
    leaves every state array bitwise as one call does, each decode step writes the ring slot
    pos mod W and the entries its ratio implies, and the release's global KV is 890 bytes per
    token."""
    ns = run_notebook("state_tour.ipynb")
    assert ns["total"] == sum(ns["groups"].values()) > 0
    assert ns["pos"] == ns["N"] > ns["cfg"].window_size
    assert len(ns["rows"]) > 20 and ns["n_same"] == len(ns["rows"])
    assert abs(ns["kl_chunks"]) < 1e-6
    assert len(ns["step_rows"]) == 6
    assert ns["g1m"] == 890 * 1048576
