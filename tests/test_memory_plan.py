"""dsv41_jax/memory_plan.py and scripts/plan_memory.py: weights by kind from the parameter
schema (checked against a real load of small.json and a hand count at the release config), the
state from init_state's shapes, the per-device rule, the command line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dsv41_jax import checkpoint, memory_plan as mp, random_weights, state as st
from dsv41_jax.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "configs", "small.json")
FLASH = os.path.join(ROOT, "configs", "flash.json")


def _tmap(cfg):
    return np.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size


def test_small_weights_and_state_match_a_real_load():
    """The eval_shape counts of small.json equal the bytes of a real load
    (``params_from_tensors(random_tensors)``) per kind, and of a real ``init_state``."""
    cfg = ModelConfig.from_json(SMALL)
    params = checkpoint.params_from_tensors(random_weights.random_tensors(cfg, 0), cfg, _tmap(cfg))
    real = dict.fromkeys(mp.WEIGHT_KINDS, 0)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        real[mp.weight_kind(jax.tree_util.keystr(path, simple=True, separator="/"))] += leaf.nbytes
    assert mp.weight_bytes(cfg) == real
    assert real["routed_experts"] > 0 and real["engram_tables"] > 0 and real["vision"] == 0
    state = st.init_state(cfg, 3, 256)
    real_state = sum(a.nbytes for a in jax.tree.leaves(state))
    assert sum(mp.state_bytes(cfg, 3, 256).values()) == real_state


def test_vision_layout_matches_the_fixture():
    """expected_vision_tensors lists exactly the tiny-vl fixture's vision-language tensors."""
    from dsv41_jax.testing.fixtures import fixture_dir
    d = fixture_dir("tiny-vl")
    cfg = ModelConfig.from_json(os.path.join(d, "config.json"))
    index = checkpoint.checkpoint_index(os.path.join(d, "weights.safetensors"))
    exp = checkpoint.expected_vision_tensors(cfg)
    text = checkpoint.expected_tensors(cfg)
    assert {n for n in index if n not in text and not n.startswith("mtp.")} == set(exp)
    for n, (shape, dtypes) in exp.items():
        assert index[n].shape == shape and index[n].dtype.name in dtypes, n


@pytest.fixture(scope="module")
def flash():
    return ModelConfig.from_json(FLASH)


def test_flash_hand_count(flash):
    """Release config, batch 8, context 131072, by hand: routed experts 384 x 3 x (2304 x 5120
    / 2 packed bytes + 2304 x 5120 / 32 scale bytes) per layer, 40 layers; Engram tables rows x
    (256 FP8 + 8 scale bytes); embedding bf16 + head fp32 129280 x 5120; global KV 890 bytes
    per token (docs/architecture.md, "Bytes per token")."""
    p = mp.plan(flash, batch=8, context=131072, devices=8)
    w = p["weights"]
    per_layer_experts = 384 * 3 * (2304 * 5120 // 2 + 2304 * 5120 // 32)
    assert per_layer_experts == 7_219_445_760
    assert w["routed_experts"] == 40 * per_layer_experts
    assert w["engram_tables"] == (384006168 + 384016682) * (256 + 8)
    assert w["embed_head"] == 129280 * 5120 * (2 + 4)
    assert w["shared_experts"] == 40 * 3 * (2304 * 5120 + 72 * 160)   # FP8 + one scale per 32x32
    assert w["vision"] > 0 and w["attention"] > 0
    s = p["state"]
    assert s["main KV (FP4)"] + s["indexer K (MXFP4)"] == 890 * 131072 * 8
    pd = p["per_device"]
    assert p["experts_per_device"] == 48 and p["rows_per_device"] == 1
    assert pd["routed_experts"] == w["routed_experts"] // 8
    assert pd["engram_tables"] == w["engram_tables"]               # replicated
    assert pd["total"] == pd["weights"] + pd["state"] + pd["activations"]
    assert not p["fits"]                                            # 203 GB of tables each
    host = mp.plan(flash, batch=8, context=131072, devices=16, engram="host")
    assert host["experts_per_device"] == 24 and host["per_device"]["engram_tables"] == 0
    assert host["host"]["Engram tables"] == w["engram_tables"]
    assert host["rows_per_device"] == 8                             # batch < devices: all rows
    assert host["per_device"]["state"] == sum(s.values())
    assert host["fits"] and host["load_fits"]
    # at load, the weights and the largest layer once more (prepare_params(..., donate=True)):
    # a layer with Engram's larger table and its 48 experts (24 with the tables on the host)
    table = 384016682 * (256 + 8)
    big = pd["load_peak"] - pd["weights"]
    assert table + per_layer_experts // 8 < big < table + per_layer_experts // 8 + 2e9
    big_host = host["per_device"]["load_peak"] - host["per_device"]["weights"]
    assert per_layer_experts // 16 < big_host < per_layer_experts // 16 + 2e9
    assert host["host"]["load: one layer's Engram tables again while prepare_params stacks "
                        "them"] == table
    sharded = mp.plan(flash, batch=8, context=131072, devices=8, engram="sharded")
    assert sharded["per_device"]["engram_tables"] == math.ceil(w["engram_tables"] / 8)
    assert p["largest_placed_tensor"]["bytes"] == 384006168 * 256 or \
        p["largest_placed_tensor"]["bytes"] == 384016682 * 256


def test_flash_on_a_mesh(flash):
    """The release config on meshes, split by dsv41_jax.sharding's table: expert=8 holds 48
    experts a device (as the simple rule), tensor=8 splits the vocabulary rows and the query
    heads / output groups but holds every expert; batch 8 over data=2 is 4 rows a device;
    Engram sharded: the padded rows over the 8 devices."""
    simple = mp.plan(flash, batch=8, context=131072, devices=8, engram="host")
    w = simple["weights"]
    ep = mp.plan(flash, batch=8, context=131072, mesh={"data": 1, "tensor": 1, "expert": 8},
                 engram="host")
    assert ep["devices"] == 8 and ep["experts_per_device"] == 48
    assert ep["per_device"]["routed_experts"] == simple["per_device"]["routed_experts"]
    assert ep["per_device"]["embed_head"] == w["embed_head"]          # replicated
    assert ep["rows_per_device"] == 8 and ep["fits"]
    tp = mp.plan(flash, batch=8, context=131072, mesh={"data": 1, "tensor": 8, "expert": 1},
                 engram="host")
    assert tp["per_device"]["embed_head"] == w["embed_head"] // 8   # vocabulary rows
    assert tp["per_device"]["routed_experts"] == w["routed_experts"]
    assert tp["per_device"]["attention"] < w["attention"] and not tp["fits"]
    mix = mp.plan(flash, batch=8, context=131072, mesh={"data": 2, "tensor": 2, "expert": 2},
                  engram="sharded")
    assert mix["rows_per_device"] == 4 and mix["experts_per_device"] == 192
    rows = 384006168 + 384016682
    assert mix["per_device"]["engram_tables"] == -(-rows // 8) * (256 + 8)
    assert "mesh data=2, tensor=2, expert=2" in mix["assumptions"][0]
    with pytest.raises(ValueError, match="devices=4 differs from the mesh's 8 devices"):
        mp.plan(flash, batch=8, context=64, devices=4, mesh={"data": 8, "tensor": 1,
                                                              "expert": 1})
    with pytest.raises(ValueError, match="n_routed_experts=384 does not divide by expert=5"):
        mp.plan(flash, batch=8, context=64, mesh={"data": 1, "tensor": 1, "expert": 5})


def test_split_rule():
    share = mp.device_share
    assert share("routed_experts", devices=16, n_routed_experts=384, engram="device") == 24 / 384
    assert share("routed_experts", devices=5, n_routed_experts=8, engram="device") == 2 / 8
    assert share("attention", devices=8, n_routed_experts=8, engram="host") == 1.0
    assert [share("engram_tables", devices=4, n_routed_experts=8, engram=e)
            for e in ("device", "sharded", "host")] == [1.0, 0.25, 0.0]
    assert [mp.rows_per_device(b, 8) for b in (1, 7, 8, 9, 64)] == [1, 7, 1, 2, 8]


@pytest.mark.parametrize("kw, msg", [
    (dict(batch=0), "batch must be an integer >= 1, got 0"),
    (dict(context=-1), "context must be an integer >= 1, got -1"),
    (dict(devices=0), "devices must be an integer >= 1, got 0"),
    (dict(chunk=0), "chunk must be an integer >= 1, got 0"),
    (dict(device_gb=0), "device_gb must be > 0, got 0"),
    (dict(engram="cpu"), "engram must be one of ('device', 'sharded', 'host'), got 'cpu'"),
])
def test_bad_arguments(kw, msg):
    cfg = ModelConfig.from_json(SMALL)
    args = dict(batch=1, context=64) | kw
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        mp.plan(cfg, **args)


def test_command_line(capsys):
    assert mp.main(["--config", SMALL, "--batch", "2", "--context", "512", "--devices", "2",
                    "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["fits"] and p["rows_per_device"] == 1 and p["experts_per_device"] == 4
    assert mp.main(["--config", SMALL, "--batch", "2", "--context", "512",
                    "--device-gb", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit in 0.01 GB" in out and "routed experts" in out and "assumptions:" in out
    assert mp.main(["--config", os.path.join(ROOT, "no.json"), "--batch", "1",
                    "--context", "1"]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    # the tables' place as dsv41-generate names it; labels printed without their details
    plans = []
    for place in ("device", "replicated"):
        assert mp.main(["--config", FLASH, "--batch", "1", "--context", "64", "--devices", "8",
                        "--engram", place]) == 0
        plans.append(capsys.readouterr().out)
    assert plans[0] == plans[1] and "on every device (replicated)" in plans[0]
    assert "  DSpark draft head " in plans[0] and "(mtp.*" not in plans[0]


def test_script_refuses_bad_arguments():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan_memory.py"),
                        "--batch", "0", "--context", "8"], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2
    assert r.stderr.strip().endswith("argument --batch: must be >= 1, got 0")
