"""Two JAX processes (``jax.distributed`` on the CPU, one device each, the routed experts split
over the two) generate the tokens of one process on one device (docs/architecture.md, "Several
hosts"); the launcher's and :mod:`dsv41_jax.distributed`'s refusals.

Both runs start at once (the launcher's workers and the one-process reference, three
processes); each compiles the tiny config's prefill and generation loop (~20 s of CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsv41_jax import distributed
from dsv41_jax.cli import multihost

from benchmarks.config import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_processes_generate_the_tokens_of_one(tmp_path):
    """Prefill + generate (greedy, 3 tokens, 2 prompts, every layer role and Engram) with two
    processes over a mesh expert=2 spanning both equals one process without a mesh, bit for
    bit (the expert psum adds two bf16 values per token: exact in fp32)."""
    cfg, _ = tiny_config("shrink")
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg.to_dict()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None) if "device_count" in env.get("XLA_FLAGS", "") else None
    runs = {n: subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "multihost.py"),
                                 "--config", str(path), "--processes", str(n)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for n in (2, 1)}
    res = {}
    for n, p in runs.items():
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-4000:]
        res[n] = json.loads(out.strip().splitlines()[-1])
    assert res[2]["processes"] == 2 and res[2]["devices"] == 2
    assert res[2]["mesh"] == {"data": 1, "tensor": 1, "expert": 2}
    assert res[1]["processes"] == 1 and res[1]["mesh"] is None
    assert res[2]["tokens"] == res[1]["tokens"] and res[2]["lengths"] == res[1]["lengths"]
    assert len(res[1]["tokens"]) == 2 and len(set(sum(res[1]["tokens"], []))) > 1


def test_refusals():
    for bad in ("localhost", "localhost:0", ":80", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="coordinator_address must be 'host:port'"):
            distributed.check_address(bad)
    assert distributed.check_address("10.0.0.1:29500") == ("10.0.0.1", 29500)
    with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes=2\), got 2"):
        distributed.initialize("localhost:1234", 2, 2)
    with pytest.raises(ValueError, match="num_processes must be an integer >= 1, got 0"):
        distributed.initialize("localhost:1234", 0, 0)
    with pytest.raises(ValueError, match="cpu_devices must be an integer >= 1, got 0"):
        distributed.initialize("localhost:1234", 2, 0, cpu_devices=0)
    with pytest.raises(SystemExit):
        multihost.build_parser().parse_args(["--config", "x.json", "--mesh", "pipe=2"])
    assert 0 < distributed.free_port() < 65536
