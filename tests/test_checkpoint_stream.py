"""Streamed checkpoint loading (dsv41_jax/checkpoint.py; docs/architecture.md, "Checkpoint
format and load-time conversions"): the same parameters as the in-memory path, a ValueError
naming the tensor and the file for each kind of bad checkpoint, and the peak host memory of a
load measured in a subprocess."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from benchmarks.config import tiny_config
from dsv41_jax import checkpoint, random_weights
from dsv41_jax.testing.fixtures import fixture_dir
from tree_checks import assert_trees_bitwise_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg():
    cfg, _ = tiny_config("drop")       # every layer role, no Engram, vocab 512
    return cfg


def _write_sharded(d, cfg, tensors: dict, n_files: int) -> list[str]:
    """``tensors`` in ``n_files`` files of about equal size (in order), plus config.json, as a
    release checkpoint directory is laid out. Returns the file paths."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)
    per = -(-sum(a.nbytes for a in tensors.values()) // n_files)
    paths, shard, size = [], {}, 0
    names = list(tensors)
    for i, name in enumerate(names):
        shard[name] = tensors[name]
        size += tensors[name].nbytes
        if size >= per or i == len(names) - 1:
            paths.append(os.path.join(d, f"model-{len(paths) + 1:05d}-of-{n_files:05d}"
                                         ".safetensors"))
            checkpoint.write_safetensors(paths[-1], shard)
            shard, size = {}, 0
    return paths


@pytest.fixture(scope="module")
def small():
    cfg = _cfg()
    return cfg, random_weights.random_tensors(cfg, seed=3)


def _file_of(d, name):
    return checkpoint.checkpoint_index(d)[name].path


# ----------------------------------------------------------------------------- same parameters


def test_streamed_load_equals_in_memory(small, tmp_path):
    """Three files, an unused ``mtp.*`` tensor and an optional one (``ffn.gate.bias_vl``):
    :func:`load_params` returns bit for bit the tree of ``params_from_tensors`` of the same
    tensors; the files' dtype codes are the reference's."""
    cfg, flat = small
    flat = dict(flat, **{"mtp.0.norm.weight": np.ones(cfg.dim, ml_dtypes.bfloat16),
                         "layers.2.ffn.gate.bias_vl": np.arange(cfg.n_routed_experts,
                                                                dtype=np.float32)})
    paths = _write_sharded(tmp_path / "ck", cfg, flat, 3)
    assert len(paths) == 3
    codes = {n: e.code for n, e in checkpoint.checkpoint_index(tmp_path / "ck").items()}
    assert codes["layers.1.ffn.experts.0.w1.weight"] == "I8"          # packed e2m1
    assert codes["layers.1.ffn.experts.0.w1.scale"] == "F8_E8M0"
    assert codes["layers.1.attn.wq_a.weight"] == "F8_E4M3"
    assert codes["embed.weight"] == "BF16" and codes["layers.1.attn.attn_sink"] == "F32"
    ref = checkpoint.params_from_tensors(flat, cfg)
    got_cfg, got = checkpoint.load_params(tmp_path / "ck")
    assert got_cfg == cfg
    assert_trees_bitwise_equal(ref, got)
    assert "bias_vl" in got["layers"][2]["ffn"]["gate"]
    assert_trees_bitwise_equal(checkpoint.read_checkpoint(tmp_path / "ck"), flat)


def test_streamed_load_of_the_reference_fixture():
    """The tiny-a fixture (written by the reference's tooling, one file): streamed and
    in-memory loads agree bit for bit."""
    d = fixture_dir("tiny-a")
    cfg, got = checkpoint.load_params(d)
    assert_trees_bitwise_equal(checkpoint.params_from_tensors(checkpoint.read_checkpoint(d), cfg),
                               got)


def test_place_sees_every_tensor_once(small, tmp_path):
    """``place(name, host)`` is called once per placed array, with the host array in its
    storage dtype; the routed experts of one layer and projection come stacked."""
    cfg, flat = small
    _write_sharded(tmp_path / "ck", cfg, flat, 2)
    seen = {}

    def place(name, host):
        assert name not in seen
        seen[name] = (host.shape, host.dtype)
        return checkpoint.default_place(name, host)

    checkpoint.load_params(tmp_path / "ck", place=place)
    E = cfg.n_routed_experts
    w1 = flat["layers.0.ffn.experts.0.w1.weight"]
    assert seen["layers.0.ffn.experts.w1.weight"] == ((E, *w1.shape), w1.dtype)
    assert "layers.0.ffn.experts.0.w1.weight" not in seen
    experts = {n for n in flat if ".ffn.experts." in n}
    assert set(seen) == (set(flat) - experts) | {
        f"layers.{i}.ffn.experts.{w}.{k}" for i in range(cfg.n_layers)
        for w in ("w1", "w2", "w3") for k in ("weight", "scale")}


# ----------------------------------------------------------------------------- errors


def test_missing_tensor_names_it_and_the_files(small, tmp_path):
    cfg, flat = small
    name = "layers.4.attn.wq_b.scale"
    _write_sharded(tmp_path / "ck", cfg, {k: v for k, v in flat.items() if k != name}, 3)
    with pytest.raises(ValueError, match=rf"missing tensor '{name}' \(not in any of the 3 "
                       rf"\*\.safetensors files in {tmp_path / 'ck'}\)"):
        checkpoint.load_params(tmp_path / "ck")


def test_wrong_shape_names_tensor_and_file(small, tmp_path):
    cfg, flat = small
    name = "layers.3.attn.compressor.wkv.weight"
    a = flat[name]
    bad = dict(flat, **{name: np.zeros((a.shape[0] + 1,) + a.shape[1:], a.dtype)})
    _write_sharded(tmp_path / "ck", cfg, bad, 3)
    f = _file_of(tmp_path / "ck", name)
    with pytest.raises(ValueError) as e:
        checkpoint.load_params(tmp_path / "ck")
    assert str(e.value) == (f"checkpoint tensor '{name}' has shape ({a.shape[0] + 1}, "
                            f"{a.shape[1]}), expected {a.shape} (stored as BF16 in {f})")


def test_wrong_dtype_names_tensor_and_file(small, tmp_path):
    cfg, flat = small
    name = "layers.5.attn.wq_b.weight"                  # FP8 in the reference format
    bad = dict(flat, **{name: flat[name].astype(ml_dtypes.bfloat16)})
    _write_sharded(tmp_path / "ck", cfg, bad, 3)
    f = _file_of(tmp_path / "ck", name)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype bfloat16, expected one "
                       rf"of \('float8_e4m3fn',\) \(stored as BF16 in {f}\)"):
        checkpoint.load_params(tmp_path / "ck")


def test_truncated_file_names_tensor_and_file(small, tmp_path):
    """A file cut short: refused from its header before any tensor is read, naming the first
    tensor whose bytes are cut off; a file shortened after its header was read: refused when
    that tensor is read."""
    cfg, flat = small
    paths = _write_sharded(tmp_path / "ck", cfg, flat, 3)
    entries = checkpoint.read_header(paths[1])
    last = max(entries.values(), key=lambda e: e.start)
    size = os.path.getsize(paths[1])
    os.truncate(paths[1], size - 10)
    with pytest.raises(ValueError, match=rf"{paths[1]}: file is truncated: tensor "
                       rf"'{last.name}' needs bytes"):
        checkpoint.load_params(tmp_path / "ck")
    with pytest.raises(ValueError, match=rf"{paths[1]}: cannot read tensor '{last.name}'"):
        checkpoint.map_tensor(last)                       # header read before the cut
    os.truncate(paths[1], 5)
    with pytest.raises(ValueError, match=rf"{paths[1]}: not a safetensors file \(truncated"):
        checkpoint.load_params(tmp_path / "ck")


def test_other_bad_files(small, tmp_path):
    """A tensor in two files, a header that is not JSON, an unsupported dtype, a byte range
    that does not fit the shape: each named with its file."""
    cfg, flat = small
    paths = _write_sharded(tmp_path / "ck", cfg, flat, 2)
    checkpoint.write_safetensors(tmp_path / "ck" / "zz.safetensors",
                                 {"norm.weight": flat["norm.weight"]})
    with pytest.raises(ValueError, match=r"tensor 'norm\.weight' is in two files: .*"
                       r"model-0000\d-of-00002\.safetensors and .*zz\.safetensors"):
        checkpoint.load_params(tmp_path / "ck")

    def raw(header: dict, data: bytes = b"") -> str:
        h = json.dumps(header).encode()
        p = str(tmp_path / "raw.safetensors")
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + data)
        return p

    p = raw({})
    with open(p, "r+b") as f:
        f.seek(8)
        f.write(b"{no")
    with pytest.raises(ValueError, match=rf"{p}: safetensors header is not valid JSON"):
        checkpoint.read_header(p)
    p = raw({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match=rf"{p}: tensor 'x' has unsupported dtype C64"):
        checkpoint.read_header(p)
    p = raw({"x": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}, bytes(4))
    with pytest.raises(ValueError, match=rf"{p}: tensor 'x' \(BF16 \[3\], 6 bytes\) has "
                       r"data_offsets \[0, 4\] of 4 bytes"):
        checkpoint.read_header(p)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no \*\.safetensors file"):
        checkpoint.load_params(tmp_path / "empty", cfg)
    assert len(paths) == 2


def test_write_refuses_a_dtype_the_format_does_not_store(tmp_path):
    with pytest.raises(ValueError, match=r"tensor 'x' has dtype float64"):
        checkpoint.write_safetensors(tmp_path / "x.safetensors", {"x": np.zeros(2)})


# ----------------------------------------------------------------------------- peak host memory

# the children's memory reading: resident and peak-resident bytes of the process
_STATUS = textwrap.dedent(r"""
    def status():
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
        return out
""")

_CHILD = _STATUS + textwrap.dedent(r"""
    import ctypes, gc, json, sys
    import jax
    from dsv41_jax import checkpoint
    from dsv41_jax.config import ModelConfig

    def live():
        return sum(a.nbytes for a in jax.live_arrays())

    d = sys.argv[1]
    cfg = ModelConfig.from_json(d + "/config.json")
    res = {}

    def measure(label, load):
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)        # freed heap back to the OS: a true baseline
        base_rss, base_live = status()["VmRSS"], live()
        transient = []

        def place(name, host):                  # the default placement, then one sample
            x = checkpoint.default_place(name, host)
            x.block_until_ready()
            transient.append(status()["VmRSS"] - base_rss - (live() - base_live))
            return x

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                        # VmHWM := VmRSS
        params = load(place)
        jax.block_until_ready(params)
        placed = sum(x.nbytes for x in jax.tree.leaves(params))
        res[label] = dict(placed=placed, max_transient=max(transient),
                          peak_increase=status()["VmHWM"] - base_rss)

    def blocked(place):
        return checkpoint.load_params(d, cfg, place=place, block_bytes=1 << 20)[1]

    measure("cold", lambda place: checkpoint.load_params(d, cfg, place=place)[1])
    measure("cold_blocked", blocked)
    measure("stream", lambda place: checkpoint.load_params(d, cfg, place=place)[1])
    measure("blocked", blocked)
    measure("in_memory", lambda place: checkpoint.params_from_tensors(
        checkpoint.read_checkpoint(d), cfg, place=place))
    print(json.dumps(res))
""")


_SLICED_CHILD = _STATUS + textwrap.dedent(r"""
    import ctypes, gc, json, sys
    import jax
    from dsv41_jax import checkpoint, sharding
    from dsv41_jax.config import ModelConfig

    d = sys.argv[1]
    cfg = ModelConfig.from_json(d + "/config.json")
    mesh = sharding.make_mesh(expert=8)
    res = {}
    for label in ("cold", "sliced"):
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
        base = status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                        # VmHWM := VmRSS
        params = checkpoint.load_params(d, cfg, mesh=mesh)[1]
        jax.block_until_ready(params)
        # every device's part (8 host devices: a replicated tensor is held 8 times)
        placed = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
        res[label] = dict(placed=placed, peak_increase=status()["VmHWM"] - base)
        del params
    print(json.dumps(res))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                    reason="needs Linux /proc (VmRSS, VmHWM and resetting VmHWM)")
def test_streamed_load_peak_host_memory(tmp_path):
    """Host memory of a streamed load of a ~180 MB four-file checkpoint, measured in a
    subprocess on the CPU backend.

    What is measured: the process's resident set (``/proc/self/status`` VmRSS), which counts
    what the loader really holds on the host: numpy buffers (the stacked experts), and the
    file pages mapped by the memmap views while they are alive (page cache pages count once
    mapped; unmapped, they do not). On the CPU backend the placed parameters live in host
    memory too, so they are subtracted: ``transient = VmRSS - baseline - bytes of the live
    JAX arrays``, sampled after each placement (when the tensor's host buffer is still alive:
    the largest moment of each step). The VmHWM high-water mark (reset before the load) bounds
    the whole load, including moments between samples: ``peak increase - placed bytes``.
    tracemalloc would miss both the mapped file pages and XLA's buffers. glibc would keep freed
    large blocks in its heap (its mmap threshold grows with use), which RSS would count as
    held: ``MALLOC_MMAP_THRESHOLD_=65536`` gives every block of 64 KiB or more its own mapping,
    returned on free, so that RSS follows what is live.

    The first load of a process also compiles the load-time conversions and pages in XLA's
    code (some tens of MB, whatever the checkpoint's size, reported as ``cold``, and
    ``cold_blocked`` for the first blocked load); the bounds are checked on a second load, and
    on a second load with ``block_bytes`` = 1 MiB (tensors placed in blocks of rows: the
    transient drops to about a block). The in-memory path (every tensor mapped at once,
    ``read_checkpoint``) is measured the same way to show that the measurement sees a
    whole-checkpoint read: its transient is the checkpoint's size.

    Bound: 3 x the largest tensor (its mapped pages, the host buffer, a staging copy) + 16 MB
    for the runtime's noise (a thread the runtime starts takes ~8 MB of stack and arena); the
    checkpoint is ~4.4 x that. Measured on the development machine: ~9-10 MB whole-tensor
    (about the 8.4 MB largest tensor), 2-9 MB blocked, ~185 MB in memory.

    Sliced onto a mesh (``load_params(..., mesh=make_mesh(expert=8))``, 8 host CPU devices, in
    a second subprocess; VmHWM only, the parts placed being every device's shards): the peak
    beyond the placed parts stays under 3 x the largest part one device reads + 16 MB
    (measured: ~4 MB).
    """
    cfg = _cfg().replace(dim=256, moe_inter_dim=512, n_routed_experts=128, vocab_size=16384)
    exp = checkpoint.expected_tensors(cfg)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, (shape, dtypes) in exp.items():          # random bytes: values do not matter
        dt = np.dtype(getattr(ml_dtypes, dtypes[0], None) or dtypes[0])
        tensors[name] = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize,
                                     np.uint8).view(dt).reshape(shape)
    E = cfg.n_routed_experts
    total = sum(a.nbytes for a in tensors.values())
    largest = max([a.nbytes for n, a in tensors.items() if ".experts." not in n]
                  + [E * a.nbytes for n, a in tensors.items() if ".experts.0." in n])
    # the largest part one device reads on a mesh expert=8: a replicated tensor whole, an
    # expert stack an eighth
    largest_part = max([a.nbytes for n, a in tensors.items() if ".experts." not in n]
                       + [E * a.nbytes // 8 for n, a in tensors.items() if ".experts.0." in n])
    _write_sharded(tmp_path / "ck", cfg, tensors, 4)
    del tensors
    assert 150e6 < total < 220e6 and largest * 8 < total

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               MALLOC_MMAP_THRESHOLD_="65536")
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "ck")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    MB = 1e6
    report = {k: {m: round(v / MB, 1) for m, v in row.items()} for k, row in res.items()}
    print(f"\ncheckpoint {total / MB:.1f} MB, largest tensor {largest / MB:.1f} MB: {report}")
    bound = 3 * largest + 16 * MB
    for s in (res["stream"], res["blocked"]):
        assert s["max_transient"] < bound, report
        assert s["peak_increase"] - s["placed"] < bound, report
        assert s["peak_increase"] - s["placed"] < total / 4, report
    assert res["blocked"]["max_transient"] < 3 * (1 << 20) + 16 * MB, report
    # the measurement does see a whole-checkpoint read
    m = res["in_memory"]
    assert m["max_transient"] > 0.8 * total, report
    assert m["peak_increase"] - m["placed"] > 0.8 * total, report

    # sliced onto a mesh of 8 host devices (experts split 8 ways, the rest replicated): the
    # host holds about one device's part of one tensor beyond the placed parts (measured on
    # the development machine: ~4 MB)
    env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=8").strip()
    r = subprocess.run([sys.executable, "-c", _SLICED_CHILD, str(tmp_path / "ck")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    sliced = json.loads(r.stdout.strip().splitlines()[-1])["sliced"]
    print(f"sliced onto 8 devices: {({k: round(v / MB, 1) for k, v in sliced.items()})}")
    assert sliced["peak_increase"] - sliced["placed"] < 3 * largest_part + 16 * MB, sliced


def test_blocked_placement(small, tmp_path):
    """With ``block_bytes`` below a tensor's size, its rows (or its experts) reach ``place`` in
    blocks and are written into one device array: the same parameters, bit for bit."""
    cfg, flat = small
    _write_sharded(tmp_path / "ck", cfg, flat, 2)
    sizes: dict = {}

    def place(name, host):
        sizes.setdefault(name, []).append(host.shape[0] if host.ndim else 1)
        return checkpoint.default_place(name, host)

    _, ref = checkpoint.load_params(tmp_path / "ck")
    _, got = checkpoint.load_params(tmp_path / "ck", place=place, block_bytes=3000)
    assert_trees_bitwise_equal(ref, got)
    V, D = flat["embed.weight"].shape
    assert sizes["embed.weight"] == [3000 // (2 * D)] * (V // (3000 // (2 * D))) + [
        V % (3000 // (2 * D))]
    w1 = flat["layers.0.ffn.experts.0.w1.weight"]            # [F, D/2] uint8: 2048 bytes
    assert sizes["layers.0.ffn.experts.w1.weight"] == [1] * cfg.n_routed_experts
    assert w1.nbytes > 1500
    assert sizes["norm.weight"] == [D]
    with pytest.raises(ValueError, match="block_bytes must be an integer >= 1, got 0"):
        checkpoint.load_params(tmp_path / "ck", block_bytes=0)


def test_read_slice_reads_its_part(tmp_path):
    """``read_slice``: a part of a tensor (bf16, FP8, E8M0, fp32, an empty range) equals
    that part of the whole tensor, as a new array (not a view of the mapped file);
    ``slice_bounds`` turns a device's index into bounds and refuses steps other than 1."""
    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.normal(0, 1, (40, 24)).astype(ml_dtypes.float8_e4m3fn),
               "a.scale": rng.integers(100, 140, (2, 1)).astype(np.uint8),
               "b": rng.normal(0, 1, (5, 3, 8)).astype(ml_dtypes.bfloat16),
               "c": np.array([3.5], np.float32)}
    checkpoint.write_safetensors(tmp_path / "t.safetensors", tensors)
    index = checkpoint.read_header(tmp_path / "t.safetensors")
    for name, idx in [("a.weight", (slice(8, 16), slice(0, 24))), ("a.weight", (slice(None),)),
                      ("a.scale", (slice(1, 2),)), ("b", (slice(2, 5), slice(1, 3), slice(4, 8))),
                      ("b", (slice(3, 3),)), ("c", (slice(0, 1),))]:
        a = tensors[name]
        got = checkpoint.read_slice(index[name], checkpoint.slice_bounds(idx, a.shape))
        assert got.dtype == a.dtype and got.base is None
        np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(a[idx]).view(
            np.uint8))
    assert checkpoint.slice_bounds((slice(None), slice(2, None)), (4, 6)) == ((0, 4), (2, 6))
    with pytest.raises(ValueError, match="step 2"):
        checkpoint.slice_bounds((slice(0, 4, 2),), (4,))
