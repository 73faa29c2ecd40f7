"""Resource report of the sparse attention kernel's GPU build, on a machine without a GPU.

Lowers :func:`pallas_kernels.sparse_attention.gpu.sparse_attention` for an H200 (mocked GPU
info, ``jax.export``), captures the Triton IR that Pallas hands to XLA and, when the standalone
``triton`` package is installed (``pip install -e .[kernel-report]``: triton 3.6.0, the GPU
machine's version), compiles it for sm_90a the way XLA does (the TTIR passes first, then
TTGIR, LLVM, PTX, cubin) and prints what decides the kernel's speed before any device time is
spent:

* registers per thread, spill bytes and stack frame (``ptxas -v``);
* shared memory (Triton's allocation);
* the SASS instruction mix: local-memory spills (STL/LDL), shared-memory stores and loads,
  ``HGMMA`` (Hopper wgmma), warp-group syncs, barriers, global loads.

XLA bundles its own Triton, so the numbers are those of Triton 3.6 on the same IR: close, not
identical. They predicted the H200 timings of the chunked kernel's variants (docs/benchmarks.md).

    python tools/triton_report.py --rows prefill --tuning '{"kv": "packed", "n_chunks": 8}'
    python tools/triton_report.py --rows prefill     # the dequantised rows' Triton kernel

(Rows of 64 heads x 512 with 128 programs or more run the Mosaic GPU kernels by default,
``kernel="mosaic_gpu"``, which are not Triton: the report covers ``kernel="triton"``.)
    python tools/triton_report.py --rows "decode B=8" --ttir-only --out /tmp/k.ttir
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import gpu_info, lowering

from pallas_kernels.sparse_attention import gpu
from pallas_kernels.sparse_attention import triton as tk
from pallas_kernels.sparse_attention import triton_dense as td

# (B, S, T, window rows, window list, top-k) at the release dims (64 heads x 512)
ROWS = {"prefill": (1, 256, 4096, 384, 128, 512), "decode B=8": (8, 1, 4096, 129, 128, 512),
        "decode B=64": (64, 1, 4096, 129, 128, 512),
        "decode B=256": (256, 1, 4096, 129, 128, 512)}
SASS_CLASSES = {"STL": r"\bSTL\b", "LDL": r"\bLDL\b", "STS": r"\bSTS\b", "LDS": r"\bLDS\b",
                "HGMMA": r"\bHGMMA\b", "HMMA": r"\bHMMA\b",
                "WARPGROUP": r"\bWARPGROUP\.(ARRIVE|DEPBAR)\b", "BAR": r"\bBAR\.(SYNC|ARV)\b",
                "LDG": r"\bLDG\b", "LDGSTS": r"\bLDGSTS\b"}


def _inputs(B, S, T, Nw, Ww, k, H=64, K=512):
    return (jnp.zeros((B, S, H, K), jnp.bfloat16), jnp.zeros((B, Nw, K), jnp.float8_e4m3fn),
            jnp.zeros((B, Nw, K // 32), jnp.uint8), jnp.zeros((B, S, Ww), jnp.int32),
            jnp.zeros((B, T, K // 2), jnp.uint8), jnp.zeros((B, T, K // 16), jnp.float8_e4m3fn),
            jnp.zeros((B, S, k), jnp.int32), jnp.zeros((H,), jnp.float32))


def capture_ttir(f, *args) -> list[str]:
    """The Triton IR (text) of every Pallas Triton kernel in ``jax.jit`` function ``f`` called
    on ``args`` (arrays or ``jax.ShapeDtypeStruct``), lowered for an H200 on any machine."""
    captured = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = lower(*a, **kw)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with mock.patch.object(gpu_info, "get_gpu_info", lambda: h200), \
            mock.patch.object(lowering, "lower_jaxpr_to_triton_module", capture):
        jax.export.export(f, platforms=["cuda"], disabled_checks=skip)(*args)
    return captured


def lower_to_ttir(rows: str, tuning: dict) -> str:
    """The Triton IR (text) of the kernel for ``rows`` (a key of :data:`ROWS`) and ``tuning``.

    Raises ``KeyError`` for an unknown row and ``ValueError`` for a tuning the kernel rejects.
    """
    # the rows of 64 x 512 heads without list splits default to the Mosaic GPU kernels:
    # report the Triton ones
    tuning = dict(tuning, kernel=tuning.get("kernel", "triton"))
    f = jax.jit(functools.partial(gpu.sparse_attention, scale=512 ** -0.5, **tuning))
    # with list splits the call also runs the split merge kernel: report the attention kernel
    # (the packed rows' kernel or, with kv="dense", the dequantised rows' kernel)
    [text] = [t for t in capture_ttir(f, *_inputs(*ROWS[rows]))
              if re.search(r"tt\.func public @csa2_sparse_attention(_rows)?\(", t)]
    return text


def is_dense(rows: str, tuning: dict) -> bool:
    """Whether the call runs the dequantised rows' kernel (kv="dense", or the default rule)."""
    B, S, T, Nw, Ww, k = ROWS[rows]
    if "kv" in tuning:
        return tuning["kv"] == "dense"
    return td.worth_it(B * S, Ww + k, B * (Nw + T))


def num_warps_of(rows: str, tuning: dict) -> tuple[int, int]:
    B, S = ROWS[rows][:2]
    n_blocks = -(-(ROWS[rows][4] + ROWS[rows][5]) // 64)
    default = (td.default_tuning(B * S, 64, n_blocks) if is_dense(rows, tuning) else
               tk.default_tuning(B * S, 64, n_blocks, 512))
    tune = dict(default, **{k: v for k, v in tuning.items() if k != "kv"})
    return tune["num_warps"], tune["num_stages"]


def compile_report(ttir: str, num_warps: int, num_stages: int, workdir: str) -> dict:
    """Compile TTIR text for sm_90a with the standalone ``triton`` package (ImportError if it
    is missing) and return registers, spills, shared memory and the SASS instruction mix."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    opts = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    src = os.path.join(workdir, "kernel.ttir")
    with open(src, "w") as f:
        f.write(ttir)
    # triton.compile starts an IR file after its own stage: run the TTIR passes (combine,
    # canonicalise, ...) first, as XLA's pipeline does for the Pallas module
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = ir.parse_mlir_module(src, ctx)
    mod.context = ctx
    mod = CUDABackend.make_ttir(mod, {}, opts, 90)
    src2 = os.path.join(workdir, "kernel_passed.ttir")
    with open(src2, "w") as f:
        f.write(str(mod))
    kernel = triton.compile(src2, target=target,
                            options={"num_warps": num_warps, "num_stages": num_stages})
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptx, cubin = os.path.join(workdir, "kernel.ptx"), os.path.join(workdir, "kernel.cubin")
    with open(ptx, "w") as f:
        f.write(kernel.asm["ptx"])
    ptxas = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "-arch=sm_90a", ptx, "-o",
                            cubin], capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin],
                          capture_output=True, text=True, check=True).stdout
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, ptxas)) else 0  # noqa: E731
    return {"registers": num(r"Used (\d+) registers"),
            "spill_store_bytes": num(r"(\d+) bytes spill stores"),
            "spill_load_bytes": num(r"(\d+) bytes spill loads"),
            "stack_frame_bytes": num(r"(\d+) bytes stack frame"),
            "shared_bytes": kernel.metadata.shared,
            "sass": {k: len(re.findall(p, sass)) for k, p in SASS_CLASSES.items()},
            "ttgir_async_copies": kernel.asm["ttgir"].count("async_copy_global_to_local")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="triton_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="prefill", choices=sorted(ROWS),
                    help="the row whose kernel is reported (default prefill)")
    ap.add_argument("--tuning", default="{}", help="JSON dict of kernel tuning keywords")
    ap.add_argument("--ttir-only", action="store_true", help="only write the Triton IR")
    ap.add_argument("--out", default=None, help="write the Triton IR (or the report JSON) here")
    args = ap.parse_args(argv)
    tuning = json.loads(args.tuning)
    ttir = lower_to_ttir(args.rows, tuning)
    if args.ttir_only:
        if args.out:
            with open(args.out, "w") as f:
                f.write(ttir)
        name = re.search(r"tt\.func public @(\w+)", ttir).group(1)
        print(f"Triton IR of {name}: {len(ttir.splitlines())} lines, "
              f"{ttir.count('tt.dot ')} tt.dot")
        return 0
    nw, ns = num_warps_of(args.rows, tuning)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report = compile_report(ttir, nw, ns, tmp)
    except ImportError:
        print("the standalone triton package is needed for the compile report: "
              ".venv/bin/pip install -c constraints.txt -e \".[kernel-report]\" (or pass "
              "--ttir-only)", file=sys.stderr)
        return 2
    report = {"rows": args.rows, "tuning": tuning, "num_warps": nw, "num_stages": ns, **report}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
