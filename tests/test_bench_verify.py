"""``dsv41-bench-verify`` (:mod:`benchmarks.speculative`): a CPU smoke run on the tiny config and
its refusals."""

from __future__ import annotations

import json

import pytest

from benchmarks import speculative


def test_smoke_run_writes_every_case(tmp_path):
    out = tmp_path / "verify.json"
    assert speculative.main(["--config", "tiny", "--batches", "2", "--drafts", "3",
                             "--steps", "2", "--fill", "exact", "--no-precompile",
                             "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "verify" and res["context"] == 64 and res["skipped"] == []
    (row,) = res["rows"]
    assert row["batch"] == 2 and row["fill_batch"] == "tile"
    dec, ver = row["cases"]
    assert (dec["kind"], dec["k"], ver["kind"], ver["k"]) == ("decode", 0, "verify", 3)
    assert dec["ms"] > 0 and ver["ms"] > 0
    assert ver["x_decode"] == pytest.approx(ver["ms"] / dec["ms"])
    assert ver["break_even_tokens_per_call"] == ver["x_decode"]
    assert dec["xla_compiles"] >= 1 and ver["xla_compiles"] >= 1   # the first calls compile


def test_budget_skips_cases(tmp_path):
    out = tmp_path / "verify.json"
    speculative.main(["--config", "tiny", "--batches", "1", "--drafts", "1", "--steps", "1",
                      "--budget-s", "1e-9", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["rows"][0]["cases"] == []
    assert [(s["kind"], s["k"]) for s in res["skipped"]] == [("decode", 0), ("verify", 1)]


@pytest.mark.parametrize("flag", ["--drafts", "--batches"])
def test_refuses_empty_or_zero(flag, capsys):
    with pytest.raises(SystemExit) as e:
        speculative.main([flag, "0"])
    assert e.value.code == 2          # as argparse's own refusals
    assert capsys.readouterr().err.strip() == \
        f"dsv41-bench-verify: error: {flag} must list integers >= 1"


def test_synthetic_fill_is_the_default(tmp_path):
    out = tmp_path / "verify.json"
    assert speculative.main(["--config", "tiny", "--batches", "3", "--drafts", "2",
                             "--steps", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["fill_mode"], row["fill_batch"]) == ("synthetic", "synthetic")
    assert [c["kind"] for c in row["cases"]] == ["decode", "verify"]
    assert all(c["ms"] > 0 for c in row["cases"])
    # precompiled together before the timing: the timed calls compile nothing
    assert row["precompile_xla_compiles"] >= 2
    assert set(row["precompile_s"]) == {"decode", "verify2", "all"}
    assert all(c["xla_compiles"] == 0 for c in row["cases"])


@pytest.mark.parametrize("argv, msg", [
    (["--mesh", "tensor"], "argument --mesh: 'tensor' is not axis=size (e.g. 'tensor=2')"),
    (["--mesh", "data=0"], "argument --mesh: the size of 'data' must be an integer >= 1, got 0"),
    (["--mesh", "expert=3"], "argument --mesh: the config's 4 routed experts do not divide by "
                             "expert=3"),
    (["--mesh", "data=2", "--batches", "2,3"], "argument --mesh: batch 3 does not divide by "
                                               "data=2 (--batches)"),
    (["--mesh", "tensor=2,expert=4"], "argument --mesh: mesh (data=1, tensor=2, expert=4) "
                                      "needs 8 devices but 1 were given"),
])
def test_mesh_refusals(argv, msg, tmp_path, capsys):
    """``--mesh``: a spec that does not parse (argparse, status 2), experts or a batch the
    mesh does not divide, a mesh of another device count: refused naming ``--mesh``, before
    any weights are made or anything compiles."""
    with pytest.raises(SystemExit) as e:
        speculative.main(["--config", "tiny", "--batches", "2", "--out", str(tmp_path / "v.json"),
                          *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "v.json").exists()

