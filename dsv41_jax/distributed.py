"""Several processes as one JAX program (docs/architecture.md, "Several hosts").

Every process (one per host, or several on one machine) calls :func:`initialize` before
anything else touches JAX's devices; ``jax.devices()`` then lists every process's devices,
a mesh of :func:`dsv41_jax.sharding.make_mesh` spans them all, and each process runs the same
program on the same host inputs (the same prompts, seeds and weights), holding only its own
devices' parts of the sharded arrays. :func:`to_host` brings a result (e.g. the generated
tokens) to every process. On a CPU the processes talk through gloo (JAX's CPU collectives).
"""

from __future__ import annotations

import socket

import jax
import numpy as np


def check_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a coordinator address ``"host:port"``; ``ValueError`` naming
    ``coordinator_address`` for anything else (no port, a port outside 1..65535)."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator_address must be 'host:port' with a port in 1..65535, "
                         f"got {address!r}")
    return host, int(port)


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               cpu_devices: int | None = None) -> None:
    """``jax.distributed.initialize`` for process ``process_id`` of ``num_processes``, the
    coordinator (process 0) listening at ``coordinator_address`` (``"host:port"``, reachable
    from every process). ``cpu_devices``: the number of CPU devices of this process (JAX's
    ``jax_num_cpu_devices``; e.g. to try several devices per process on one machine), None
    to leave it. Call it first, before any JAX computation.

    Raises ``ValueError`` for a bad address, ``num_processes`` < 1, ``process_id`` outside
    ``[0, num_processes)`` or ``cpu_devices`` < 1."""
    check_address(coordinator_address)
    for name, v, lo in (("num_processes", num_processes, 1), ("process_id", process_id, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if process_id >= num_processes:
        raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got "
                         f"{process_id}")
    if cpu_devices is not None:
        if isinstance(cpu_devices, bool) or not isinstance(cpu_devices, (int, np.integer)) \
                or cpu_devices < 1:
            raise ValueError(f"cpu_devices must be an integer >= 1, got {cpu_devices!r}")
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=int(num_processes), process_id=int(process_id))


def to_host(x) -> np.ndarray:
    """A (possibly sharded over several processes) array as a whole numpy array, in every
    process (``jax.experimental.multihost_utils.process_allgather`` when other processes hold
    parts of it; every process must call it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def free_port() -> int:
    """A TCP port free on this machine now (for a coordinator on ``localhost``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
