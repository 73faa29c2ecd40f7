"""Prefill and generate with several JAX processes on one machine (``jax.distributed``, CPU):
the multi-host setup, tried locally (docs/architecture.md, "Several hosts").

Launcher (the default): starts ``--processes`` copies of this program as workers, the
coordinator on ``localhost`` at a free port, each worker with ``--cpu-devices`` CPU devices,
waits for them and prints process 0's result (one JSON line: the generated tokens, the
process and device counts). Worker (``--process-id``): :func:`dsv41_jax.distributed.initialize`,
a mesh over every process's devices, seeded random weights and prompts (the same in every
process), prefill and :func:`dsv41_jax.generation.generate` on the mesh, the tokens gathered.
``--processes 1`` runs one process without ``jax.distributed`` (and without a mesh when it
has one device): the reference the several-process tokens must equal.

    python scripts/multihost.py --config cfg.json --processes 2 --mesh expert=2
    python scripts/multihost.py --config cfg.json --processes 1 --cpu-devices 1

On several hosts run the worker on each, with the first host's address as the coordinator:

    python scripts/multihost.py --config cfg.json --mesh tensor=8,expert=2 \\
        --coordinator host0:29500 --processes 2 --process-id 0     # on host0
    ... --process-id 1                                              # on host1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from dsv41_jax.cli.args import Parser, mesh_spec, positive_int

def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="multihost", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, metavar="PATH",
                    help="model config JSON (seeded random weights of it)")
    ap.add_argument("--processes", type=positive_int, default=2, metavar="N",
                    help="number of processes (default 2)")
    ap.add_argument("--cpu-devices", type=positive_int, default=1, metavar="N",
                    help="CPU devices per process (default 1)")
    ap.add_argument("--mesh", type=mesh_spec, default=None, metavar="data=D,tensor=T,expert=E",
                    help="the mesh over every process's devices (default: expert over all)")
    ap.add_argument("--batch", type=positive_int, default=2, help="prompts (default 2)")
    ap.add_argument("--prompt-len", type=positive_int, default=12, metavar="N",
                    help="tokens per prompt (default 12)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=3, metavar="N")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    ap.add_argument("--timeout", type=positive_int, default=600, metavar="S",
                    help="launcher: seconds to wait for the workers")
    ap.add_argument("--process-id", type=int, default=None,
                    help="run as this worker (0 is the coordinator); default: launch them")
    ap.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                    help="worker: the coordinator's address")
    ap.add_argument("--out", default=None, metavar="PATH",
                    help="process 0 writes its result JSON here")
    return ap


def _worker(args) -> dict:
    """One process's run (module docstring); returns the result (every process)."""
    import numpy as np

    from dsv41_jax import distributed

    if args.processes > 1:
        distributed.initialize(args.coordinator, args.processes, args.process_id,
                               cpu_devices=args.cpu_devices)
    else:
        import jax
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import jax

    from dsv41_jax import checkpoint, generation, model, random_weights, sharding, state as st
    from dsv41_jax.config import ModelConfig

    cfg = ModelConfig.from_json(args.config)
    n_dev = jax.device_count()
    sizes = args.mesh or {"data": 1, "tensor": 1, "expert": n_dev}
    mesh = None if n_dev == 1 and args.mesh is None else sharding.make_mesh(**sizes)
    # Engram's compressed token map: the tokenizer's, or the identity for a reduced vocabulary
    # that is its own compressed vocabulary (the tests' tiny configs)
    token_map = (np.arange(cfg.vocab_size, dtype=np.int32)
                 if cfg.engram_layer_ids and cfg.engram_compressed_vocab_size == cfg.vocab_size
                 else None)
    params = model.prepare_params(checkpoint.params_from_tensors(
        random_weights.random_tensors(cfg, args.seed), cfg, token_map), cfg)
    if mesh is not None:   # every process holds the same values: each keeps its devices' parts
        params = sharding.shard_params(jax.tree.map(np.asarray, params), cfg, mesh)
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
    state = st.init_state(cfg, args.batch, args.prompt_len + args.max_new_tokens)
    if mesh is not None:
        state = sharding.shard_state(jax.tree.map(np.asarray, state), mesh)
    out, state = model.prefill(params, cfg, tokens, state, mesh=mesh)
    res = generation.generate(params, cfg, state, out.logits,
                              max_new_tokens=args.max_new_tokens, mesh=mesh)
    return {"tokens": distributed.to_host(res.tokens).tolist(),
            "lengths": distributed.to_host(res.lengths).tolist(),
            "processes": jax.process_count(), "devices": n_dev,
            "mesh": None if mesh is None else dict(mesh.shape)}


def launch(args, argv: list[str]) -> dict:
    """Start the workers (module docstring); returns process 0's result. Raises
    ``RuntimeError`` with a worker's output when one fails or the wait times out."""
    import tempfile

    from dsv41_jax import distributed

    coordinator = f"localhost:{distributed.free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        for i in range(args.processes):
            cmd = [sys.executable, "-m", "dsv41_jax.cli.multihost", *argv, "--process-id",
                   str(i), "--coordinator", coordinator, "--out", out]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env=dict(os.environ, JAX_PLATFORMS="cpu")))
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=args.timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"the workers did not finish in {args.timeout} s") from None
        for i, (p, log) in enumerate(zip(procs, logs)):
            if p.returncode != 0:
                raise RuntimeError(f"worker {i} failed (status {p.returncode}):\n{log[-4000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.process_id is None:
        try:
            res = launch(args, argv)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(json.dumps(res))
        return 0
    res = _worker(args)
    if args.process_id == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
