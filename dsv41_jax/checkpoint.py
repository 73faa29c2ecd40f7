"""Reading reference-format checkpoints (safetensors in the reference's names and dtypes).

The raw reader returns numpy arrays in storage dtypes that JAX understands:
``BF16 -> bfloat16``, ``F32 -> float32``, ``F8_E4M3 -> float8_e4m3fn``,
``F8_E8M0 -> uint8`` (the exponent byte, value ``2**(u-127)``), ``I8 -> uint8`` (packed e2m1,
two codes per byte). See docs/architecture.md, "Quantised linears", "Number formats" and
"Checkpoint format and load-time conversions".

Loading streams (:func:`load_params`): the files' headers are read and checked against the
expected layout first (no tensor data read), then the tensors are read one at a time as
zero-copy ``np.memmap`` views of their byte ranges, each placed on the device and converted
before the next one is read (a tensor above 1 GiB in blocks of rows), so the host holds about
one tensor at a time, never a file or the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": np.uint8, "I8": np.uint8, "U8": np.uint8,
    "I32": np.int32, "I64": np.int64,
}

#: Largest safetensors header this reader accepts (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000


# ----------------------------------------------------------------------------- files


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a ``.safetensors`` file lies (from the file's header, no data read).

    ``code``: the stored dtype code (``"F8_E4M3"``, ...); ``dtype``: the numpy dtype it is read
    as (:data:`_DTYPES`); ``start``: absolute byte offset of the data in the file; ``nbytes``:
    ``prod(shape) * itemsize``.
    """

    name: str
    path: str
    code: str
    shape: tuple
    start: int
    nbytes: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(_DTYPES[self.code])


def read_header(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """The tensors of one ``.safetensors`` file, from its header only (8-byte little-endian
    header length, a JSON object ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``
    with offsets relative to the data after the header; see the safetensors format).

    Raises ``ValueError`` naming the file (and the tensor) for: a file too short for its
    header, a header that is not such a JSON object, a dtype this model never stores, a byte
    range whose length is not ``prod(shape) * itemsize``, and a truncated file (a tensor whose
    bytes end beyond the end of the file).
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (truncated: {size} bytes, shorter "
                             "than the 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(f"{path}: not a safetensors file or truncated: header length {n} "
                             f"but the file holds {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    data_start, data_size = 8 + n, size - 8 - n
    out: dict[str, TensorEntry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape = spec["dtype"], tuple(int(d) for d in spec["shape"])
            begin, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {spec!r}"
                             ) from None
        dt = _DTYPES.get(code)
        if dt is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {code}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        if end - begin != nbytes or begin < 0:
            raise ValueError(f"{path}: tensor {name!r} ({code} {list(shape)}, {nbytes} bytes) "
                             f"has data_offsets [{begin}, {end}] of {end - begin} bytes")
        out[name] = TensorEntry(name, path, code, shape, data_start + begin, nbytes)
    short = [e for e in out.values() if e.start + e.nbytes > size]
    if short:
        e = min(short, key=lambda e: e.start)
        raise ValueError(f"{path}: file is truncated: tensor {e.name!r} needs bytes "
                         f"{e.start - data_start}..{e.start - data_start + e.nbytes} of the data "
                         f"section but it holds only {data_size} bytes "
                         f"({len(short)} tensor{'s' * (len(short) > 1)} cut off)")
    return out


def map_tensor(entry: TensorEntry) -> np.ndarray:
    """One tensor as a read-only numpy array of its storage dtype (``entry.dtype``,
    ``entry.shape``): a zero-copy ``np.memmap`` of its byte range, backed by the page cache;
    the mapping is released when the array (and every view of it) is dropped.

    Raises ``ValueError`` naming the tensor and the file if the file no longer holds its bytes
    (shortened since its header was read).
    """
    if entry.nbytes == 0:
        return np.zeros(entry.shape, entry.dtype)
    try:
        mm = np.memmap(entry.path, dtype=np.uint8, mode="r", offset=entry.start,
                       shape=(entry.nbytes,))
    except (ValueError, OSError) as e:
        raise ValueError(f"{entry.path}: cannot read tensor {entry.name!r} (bytes "
                         f"{entry.start}..{entry.start + entry.nbytes} of the file): {e}"
                         ) from None
    return np.frombuffer(mm, entry.dtype).reshape(entry.shape)


def slice_bounds(index, shape: tuple) -> tuple[tuple[int, int], ...]:
    """``((start, stop), ...)`` per dimension of ``shape`` of ``index``, a tuple of ``slice`` s
    of step 1 (missing trailing ones: whole), as
    ``jax.sharding.Sharding.addressable_devices_indices_map`` gives them. Raises
    ``ValueError`` for a step other than 1 or more slices than dimensions."""
    index = tuple(index)
    if len(index) > len(shape):
        raise ValueError(f"index {index} has more slices than the shape {shape} dimensions")
    out = []
    for i, n in enumerate(shape):
        start, stop, step = (index[i] if i < len(index) else slice(None)).indices(n)
        if step != 1:
            raise ValueError(f"index {index}: dimension {i} has step {step}, only 1 is read")
        out.append((start, max(start, stop)))
    return tuple(out)


def read_slice(entry: TensorEntry, bounds: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The part ``bounds`` (``((start, stop), ...)`` per dimension, :func:`slice_bounds`) of
    one tensor, as a new numpy array of its storage dtype: only the leading axis' rows
    ``start .. stop`` are mapped (:func:`map_tensor` of their byte range) and only the part is
    copied out of them, so the host holds the part, not the tensor. (Not
    ``safetensors.safe_open(..., "numpy").get_slice``: safetensors 0.8's numpy reader has no
    FP8 dtypes.)

    Raises ``ValueError`` as :func:`map_tensor` does."""
    if not entry.shape:
        return np.array(map_tensor(entry))
    (lo, hi), rest = bounds[0], bounds[1:]
    row = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    rows = map_tensor(dataclasses.replace(entry, shape=(hi - lo,) + entry.shape[1:],
                                          start=entry.start + lo * row,
                                          nbytes=(hi - lo) * row))
    return np.array(rows[(slice(None),) + tuple(slice(a, b) for a, b in rest)])


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as numpy arrays in their storage dtypes.

    The arrays are read-only views of one ``np.memmap`` of the file (zero-copy: the bytes are
    paged in from the page cache when used). Raises ``ValueError`` as :func:`read_header` does.
    """
    entries = read_header(path)
    if not entries:
        return {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return {name: np.frombuffer(mm, e.dtype, count=int(np.prod(e.shape, dtype=np.int64)),
                                offset=e.start).reshape(e.shape)
            for name, e in entries.items()}


#: numpy dtype name -> the safetensors dtype name that stores it (uint8: see
#: :func:`write_safetensors`).
_STORE_NAMES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16",
                "float8_e4m3fn": "float8_e4m3fn", "int32": "int32", "int64": "int64"}


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (numpy arrays in the storage dtypes :func:`read_safetensors` returns)
    as one ``.safetensors`` file in the reference's dtype codes (``safetensors.serialize_file``,
    no copy of the data): ``uint8`` tensors named ``*.scale`` are written as ``F8_E8M0``, other
    ``uint8`` ones as ``I8`` (packed e2m1), the rest as their own dtype.

    Raises ``ValueError`` naming a tensor of a dtype the reference format does not store.
    """
    keep, specs = [], {}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        keep.append(a)
        if a.dtype == np.uint8:
            store = "float8_e8m0fnu" if name.endswith(".scale") else "int8"
        elif a.dtype.name in _STORE_NAMES:
            store = _STORE_NAMES[a.dtype.name]
        else:
            raise ValueError(f"tensor {name!r} has dtype {a.dtype}, which the reference "
                             "checkpoint format does not store")
        specs[name] = safetensors.TensorSpec(dtype=store, shape=list(a.shape),
                                             data_ptr=a.ctypes.data, data_len=a.nbytes)
    safetensors.serialize_file(specs, os.fspath(path), metadata)
    del keep


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The ``*.safetensors`` files of a checkpoint directory (sorted), or ``[path]`` for a file.

    Raises ``ValueError`` for a directory that holds none, ``FileNotFoundError`` for a path
    that does not exist.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"checkpoint directory {path!r} holds no *.safetensors file")
        return [os.path.join(path, f) for f in files]
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    return [path]


def checkpoint_index(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint (directory or file) -> where it lies, from the files'
    headers only. Raises ``ValueError`` as :func:`read_header` does, and naming a tensor held
    by two files (and both files)."""
    index: dict[str, TensorEntry] = {}
    for f in checkpoint_files(path):
        for name, e in read_header(f).items():
            if name in index:
                raise ValueError(f"checkpoint tensor {name!r} is in two files: "
                                 f"{index[name].path} and {f}")
            index[name] = e
    return index


def nest(flat: dict[str, Any]) -> dict:
    """``{"layers.0.attn.wq_a.weight": a}`` -> ``{"layers": {0: {"attn": {"wq_a": {...}}}}}``.

    The leaves are kept as they are (numpy or device arrays). Numeric path components become
    int keys (use :func:`as_list` to turn them into lists).
    """
    root: dict = {}
    for name, arr in flat.items():
        node = root
        parts = [int(p) if p.isdigit() else p for p in name.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = arr
    return root


# ----------------------------------------------------------------------------- expected layout


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _linear_entries(out: dict, name: str, o: int, i: int, quantized: bool) -> None:
    """A linear ``[o, i]``'s entries in ``out``: FP8 weight and E8M0 scales per 32 x 32 block
    (``quantized``), else a bf16 weight."""
    if quantized:
        out[f"{name}.weight"] = ((o, i), ("float8_e4m3fn",))
        out[f"{name}.scale"] = ((_cdiv(o, 32), _cdiv(i, 32)), ("uint8",))
    else:
        out[f"{name}.weight"] = ((o, i), ("bfloat16",))


def _block_tensors(out: dict, cfg, p: str, E: int) -> None:
    """The tensors every block holds (attention without indexer / compressor, mHC heads, MoE
    with ``E`` routed experts) under the prefix ``p``, added to ``out``."""
    D, H, K, Q = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    G, O, F, C = cfg.o_groups, cfg.o_lora_rank, cfg.moe_inter_dim, cfg.hc_mult
    fp8 = cfg.dtype == "fp8"
    fp4 = cfg.expert_dtype == "fp4"
    bf16, f32, f8, e8, i8 = ("bfloat16",), ("float32",), ("float8_e4m3fn",), ("uint8",), ("uint8",)

    def lin(name, o, i, quantized=fp8):
        _linear_entries(out, name, o, i, quantized)

    out[f"{p}.attn.attn_sink"] = ((H,), f32)
    lin(f"{p}.attn.wq_a", Q, D)
    out[f"{p}.attn.q_norm.weight"] = ((Q,), bf16)
    lin(f"{p}.attn.wq_b", H * K, Q)
    lin(f"{p}.attn.wkv", K, D)
    out[f"{p}.attn.kv_norm.weight"] = ((K,), bf16)
    lin(f"{p}.attn.wo_a", G * O, H * K // G)
    lin(f"{p}.attn.wo_b", D, G * O)
    out[f"{p}.attn_norm.weight"] = ((D,), bf16)
    out[f"{p}.ffn_norm.weight"] = ((D,), bf16)
    for h in ("attn", "ffn"):
        out[f"{p}.hc_{h}_fn"] = (((2 + C) * C, C * D), f32)
        out[f"{p}.hc_{h}_base"] = (((2 + C) * C,), f32)
        out[f"{p}.hc_{h}_scale"] = ((3,), f32)
    out[f"{p}.ffn.gate.weight"] = ((E, D), bf16)
    out[f"{p}.ffn.gate.bias"] = ((E,), f32)
    for e in range(E):
        for w, (o, i) in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
            n = f"{p}.ffn.experts.{e}.{w}"
            if fp4:
                out[f"{n}.weight"] = ((o, i // 2), i8)
                out[f"{n}.scale"] = ((o, i // 32), e8)
            else:
                lin(n, o, i)
    lin(f"{p}.ffn.shared_experts.w1", F, D)
    lin(f"{p}.ffn.shared_experts.w3", F, D)
    lin(f"{p}.ffn.shared_experts.w2", D, F)


def expected_dspark_tensors(cfg) -> dict[str, tuple[tuple, tuple]]:
    """The DSpark draft head's tensors (``mtp.*``; docs/architecture.md, "DSpark draft head"):
    name -> (shape, allowed dtypes); empty when the config has DSpark off. Each stage
    ``mtp.k`` is a full block (SWA-only attention, MoE with ``cfg.dspark_experts``);
    ``mtp.0`` adds ``main_proj`` / ``main_norm``, the last stage ``norm``, ``markov_head``
    and ``confidence_head``."""
    if not cfg.dspark_on:
        return {}
    D, V, M = cfg.dim, cfg.vocab_size, cfg.dspark_markov_rank
    T = len(cfg.dspark_target_layer_ids)
    bf16, f32 = ("bfloat16",), ("float32",)
    out: dict = {}
    E, _ = cfg.dspark_experts
    for k in range(cfg.n_mtp_layers):
        _block_tensors(out, cfg, f"mtp.{k}", E)
    if cfg.dtype == "fp8":
        out["mtp.0.main_proj.weight"] = ((D, T * D), ("float8_e4m3fn",))
        out["mtp.0.main_proj.scale"] = ((_cdiv(D, 32), _cdiv(T * D, 32)), ("uint8",))
    else:
        out["mtp.0.main_proj.weight"] = ((D, T * D), bf16)
    out["mtp.0.main_norm.weight"] = ((D,), bf16)
    last = f"mtp.{cfg.n_mtp_layers - 1}"
    out[f"{last}.norm.weight"] = ((D,), bf16)
    out[f"{last}.markov_head.embed.weight"] = ((V, M), bf16)
    out[f"{last}.markov_head.head.weight"] = ((V, M), bf16 + f32)
    out[f"{last}.confidence_head.proj.weight"] = ((1, D + M), bf16 + f32)
    return out


def expected_tensors(cfg) -> dict[str, tuple[tuple, tuple]]:
    """Every text-model tensor the reference format holds: name -> (shape, allowed dtypes).

    The reference's names, shapes and dtypes per layer kind (docs/architecture.md,
    "Checkpoint format and load-time conversions"), scaled by ``cfg``. DSpark (``mtp.*``) and
    vision tensors are not listed (they are optional for the text model).
    """
    from dsv41_jax.config import LayerPlan

    plan = LayerPlan.from_config(cfg)
    D, H, K, Q = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    G, O, I, J = cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    E, F, C = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.hc_mult
    fp8 = cfg.dtype == "fp8"
    fp4 = cfg.expert_dtype == "fp4"
    bf16, f32, f8, e8, i8 = ("bfloat16",), ("float32",), ("float8_e4m3fn",), ("uint8",), ("uint8",)
    out: dict = {}

    def lin(name, o, i, quantized=fp8):
        _linear_entries(out, name, o, i, quantized)

    out["embed.weight"] = ((cfg.vocab_size, D), bf16)
    out["norm.weight"] = ((D,), bf16)
    out["head.weight"] = ((cfg.vocab_size, D), bf16 + f32)
    for role in plan.roles:
        p = f"layers.{role.layer}"
        _block_tensors(out, cfg, p, E)
        if role.owns_index:
            lin(f"{p}.attn.indexer.wq_b", I * J, Q)
            out[f"{p}.attn.indexer.weights_proj.weight"] = ((I, D), bf16)
        if role.owns_kv:
            out[f"{p}.attn.compressor.wkv.weight"] = ((K, D), bf16 + f32)
            if role.ratio > 1:
                out[f"{p}.attn.compressor.wgate.weight"] = ((K, D), bf16 + f32)
            out[f"{p}.attn.compressor.norm.weight"] = ((K,), bf16)
            out[f"{p}.attn.indexer.wk.weight"] = ((J, K), bf16)
            out[f"{p}.attn.indexer.k_norm.weight"] = ((J,), bf16)
    for k, layer in enumerate(cfg.engram_layer_ids):
        p = f"layers.{layer}.engram"
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        rows, hd = cfg.engram_num_embeddings[k], cfg.engram_head_dim
        out[f"{p}.embed.weight"] = ((rows, hd), f8)
        out[f"{p}.embed.scale"] = ((rows, hd // 32), e8)
        lin(f"{p}.wkv", (C + 1) * D, cols * hd, quantized=True)
        out[f"{p}.q_weight"] = ((C, D), bf16)
        out[f"{p}.k_weight"] = ((C, D), bf16)
    return out


def expected_vision_tensors(cfg) -> dict[str, tuple[tuple, tuple]]:
    """The optional vision-language tensors of the reference format (``{}`` when
    ``cfg.vision_n_layers`` is 0): name -> (shape, allowed dtypes), as the tiny-vl fixture
    holds them (docs/architecture.md, "Vision transformer and aligner"): the ViT (bf16 linears
    with biases, fused ``wqkv`` [3V, V] and gate/up ``mlp.w1`` [2F, V]), the aligner (3x3
    unfold -> [D, V r^2] -> [D, D]), the image-span rows and each layer's routing bias for
    image tokens ``ffn.gate.bias_vl`` (fp32 [E]). The loader places them when present and
    does not check them; :mod:`dsv41_jax.memory_plan` counts them.
    """
    if not cfg.vision_n_layers:
        return {}
    V, F, D, p = cfg.vision_dim, cfg.vision_inter_dim, cfg.dim, cfg.vision_patch_size
    r = cfg.vision_downsample_ratio
    bf16, f32 = ("bfloat16",), ("float32",)
    out: dict = {"vision.patch_embed.proj.weight": ((V, 3 * p * p), bf16),
                 "vision.patch_embed.proj.bias": ((V,), bf16)}
    for i in range(cfg.vision_n_layers):
        b = f"vision.blocks.{i}"
        out[f"{b}.norm1.weight"] = ((V,), bf16)
        out[f"{b}.attn.wqkv.weight"] = ((3 * V, V), bf16)
        out[f"{b}.attn.wqkv.bias"] = ((3 * V,), bf16)
        out[f"{b}.attn.wo.weight"] = ((V, V), bf16)
        out[f"{b}.attn.wo.bias"] = ((V,), bf16)
        out[f"{b}.norm2.weight"] = ((V,), bf16)
        out[f"{b}.mlp.w1.weight"] = ((2 * F, V), bf16)
        out[f"{b}.mlp.w2.weight"] = ((V, F), bf16)
    out["vision.norm.weight"] = ((V,), bf16)
    out["aligner.w1.weight"] = ((D, V * r * r), bf16)
    out["aligner.w1.bias"] = ((D,), bf16)
    out["aligner.w2.weight"] = ((D, D), bf16)
    out["aligner.w2.bias"] = ((D,), bf16)
    for name in ("image_start", "image_end", "image_newline"):
        out[name] = ((D,), bf16)
    for i in range(cfg.n_layers):
        out[f"layers.{i}.ffn.gate.bias_vl"] = ((cfg.n_routed_experts,), f32)
    return out


def _check_layout(found: Mapping[str, tuple[tuple, str]], cfg, where: Callable[[str], str],
                  missing_where: str = "") -> None:
    """Raise ``ValueError`` naming the first missing tensor or wrong shape / dtype.

    ``found``: name -> (shape, numpy dtype name) of what the checkpoint holds; ``where(name)``
    is appended to the message for a tensor of the wrong shape or dtype (``""``, or ``" (stored
    as CODE in FILE)"``), ``missing_where`` to the message for a missing tensor.
    """
    exp = expected_tensors(cfg)
    if any(n.startswith("mtp.") for n in found):   # DSpark shipped: all of it, as expected
        exp.update(expected_dspark_tensors(cfg))
    missing = [n for n in exp if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}{more}{missing_where}")
    for name, (shape, dtypes) in exp.items():
        got_shape, got_dtype = found[name]
        if tuple(got_shape) != tuple(shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got_shape)}, expected "
                             f"{tuple(shape)}{where(name)}")
        if got_dtype not in dtypes:
            raise ValueError(f"checkpoint tensor {name!r} has dtype {got_dtype}, expected one of "
                             f"{dtypes}{where(name)}")


def validate_tensors(flat: dict[str, np.ndarray], cfg) -> None:
    """Raise ``ValueError`` naming the first missing tensor or wrong shape / dtype."""
    _check_layout({n: (a.shape, str(a.dtype)) for n, a in flat.items()}, cfg, lambda n: "")


def validate_index(index: Mapping[str, TensorEntry], cfg) -> None:
    """:func:`validate_tensors` for a checkpoint's headers (:func:`checkpoint_index`): raise
    ``ValueError`` naming the first missing tensor (and the files searched) or a tensor of the
    wrong shape or dtype and the file that holds it. No tensor data is read."""
    files = sorted({e.path for e in index.values()})
    dirs = sorted({os.path.dirname(f) for f in files})
    searched = (f" (not in any of the {len(files)} *.safetensors files in {dirs[0]})"
                if len(dirs) == 1 and len(files) > 1 else
                f" (not in {', '.join(files)})" if files else " (no tensors found)")

    def where(name):
        e = index[name]
        return f" (stored as {e.code} in {e.path})"
    _check_layout({n: (e.shape, e.dtype.name) for n, e in index.items()}, cfg, where, searched)


# ----------------------------------------------------------------------------- loading


def read_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (every ``*.safetensors`` in it) or one file, as
    zero-copy views of the mapped files (:func:`read_safetensors`). Prefer :func:`load_params`,
    which streams: converted, every tensor here would be paged in together."""
    flat: dict = {}
    origin: dict = {}
    for f in checkpoint_files(path):
        for name, a in read_safetensors(f).items():
            if name in flat:
                raise ValueError(f"checkpoint tensor {name!r} is in two files: {origin[name]} "
                                 f"and {f}")
            flat[name], origin[name] = a, f
    return flat


def engram_params(cfg, tokenizer_map=None) -> dict:
    """``engram_token_map`` (int32 [V]) and the hashing constants of the Engram layers
    (docs/architecture.md, "Engram").

    ``tokenizer_map`` defaults to the compressed map built from the real tokenizer. Raises
    ``ValueError`` if its number of ids is not ``cfg.engram_compressed_vocab_size``.
    """
    import jax.numpy as jnp

    from dsv41_jax.layers import engram as engram_layer
    if tokenizer_map is None:
        from dsv41_jax import tokenizer as tok
        tokenizer_map = tok.build_compressed_token_map(tok.load_tokenizer())
    if len(np.unique(tokenizer_map)) != cfg.engram_compressed_vocab_size:
        raise ValueError(f"compressed token map has {len(np.unique(tokenizer_map))} ids, "
                         f"config says engram_compressed_vocab_size="
                         f"{cfg.engram_compressed_vocab_size}")
    consts = engram_layer.engram_constants(cfg, tokenizer_map)
    return {"engram_token_map": jnp.asarray(tokenizer_map, jnp.int32),
            "engram_consts": {k: jnp.asarray(v) for k, v in
                              engram_layer.engram_hash_constants(consts).items()}}


def default_place(name: str, host: np.ndarray):
    """Where the loaders put each tensor by default: ``jnp.asarray`` (a copy on JAX's default
    device; never an alias of the mapped file, which on CPU ``jax.device_put`` can make)."""
    import jax.numpy as jnp
    return jnp.asarray(host)


def _assemble(cfg, names, fetch: Callable[[str], Any], stack: Callable[[str, list], Any],
              tokenizer_map=None) -> dict:
    """The model's parameter pytree from the reference tensors ``names`` (already validated),
    reading each one when it is placed: ``fetch(name)`` -> one tensor on the device,
    ``stack(stacked_name, names)`` -> the tensors ``names`` stacked on a new leading axis, on
    the device. The load-time conversions (docs/architecture.md, "Checkpoint format and
    load-time conversions") run on the device right after their tensors are placed. ``mtp.*``
    (DSpark) is read when the config has DSpark on and the checkpoint ships it; top-level
    tensors the model does not use are never read."""
    import jax.numpy as jnp

    from dsv41_jax import quant
    from dsv41_jax.config import LayerPlan

    plan = LayerPlan.from_config(cfg)
    tree = nest({n: n for n in names})   # leaves: tensor names

    def conv(x):
        return fetch(x) if isinstance(x, str) else {k: conv(v) for k, v in x.items()}

    def block_params(lt, prefix, n_experts, fp32_compressor):
        lp = {k: conv(v) for k, v in lt.items() if k not in ("ffn",)}
        wo_a = lp["attn"]["wo_a"]
        if "scale" in wo_a:
            lp["attn"]["wo_a"] = {"weight": quant.dequant_fp8_weight(wo_a["weight"], wo_a["scale"])}
        if fp32_compressor:
            comp = lp["attn"]["compressor"]
            for w in ("wkv", "wgate"):
                comp[w] = {"weight": comp[w]["weight"].astype(jnp.float32)}
        ffn = lt["ffn"]
        experts = [ffn["experts"][e] for e in range(n_experts)]
        p = f"{prefix}.ffn.experts"
        stacked = {w: {k: stack(f"{p}.{w}.{k}", [ex[w][k] for ex in experts])
                       for k in experts[0][w]} for w in ("w1", "w2", "w3")}
        lp["ffn"] = {"gate": conv(ffn["gate"]), "experts": stacked,
                     "shared_experts": conv(ffn["shared_experts"])}
        return lp

    params: dict = {"embed": conv(tree["embed"]), "norm": conv(tree["norm"]),
                    "head": {"weight": fetch("head.weight").astype(jnp.float32)}}
    layers = []
    for role in plan.roles:
        layers.append(block_params(tree["layers"][role.layer], f"layers.{role.layer}",
                                   cfg.n_routed_experts, role.owns_kv and role.ratio > 1))
    params["layers"] = layers
    if cfg.dspark_on and "mtp" in tree:
        params["dspark"] = _dspark_params(cfg, tree["mtp"], conv, block_params, fetch)
    if cfg.engram_layer_ids:
        params.update(engram_params(cfg, tokenizer_map))
    for name in ("image_start", "image_end", "image_newline"):
        if name in tree:
            params[name] = fetch(name)
    if "vision" in tree:
        params["vision"] = conv(tree["vision"])
        params["aligner"] = conv(tree["aligner"])
    return params


def _dspark_params(cfg, mtp: dict, conv, block_params, fetch) -> dict:
    """The DSpark draft head's parameters (docs/architecture.md, "DSpark draft head") from the
    nested ``mtp.*`` tensor names: ``stages`` (one block per stage, as the backbone's),
    ``main_proj`` / ``main_norm`` (``mtp.0``), and the last stage's ``norm``,
    ``markov_embed``, ``markov_head`` and ``confidence`` (the last two upcast to fp32, as the
    reference holds them)."""
    import jax.numpy as jnp

    E, _ = cfg.dspark_experts
    n = cfg.n_mtp_layers
    last = mtp[n - 1]
    return {"stages": [block_params({k: v for k, v in mtp[k].items()
                                     if k not in ("main_proj", "main_norm", "norm",
                                                  "markov_head", "confidence_head")},
                                    f"mtp.{k}", E, False) for k in range(n)],
            "main_proj": conv(mtp[0]["main_proj"]), "main_norm": conv(mtp[0]["main_norm"]),
            "norm": conv(last["norm"]),
            "markov_embed": conv(last["markov_head"]["embed"]),
            "markov_head": {"weight": fetch(last["markov_head"]["head"]["weight"]
                                            ).astype(jnp.float32)},
            "confidence": {"weight": fetch(last["confidence_head"]["proj"]["weight"]
                                           ).astype(jnp.float32)}}


def _placed(place, name, host):
    """``place(name, host)``, waited for, so that the host array can go before the next read."""
    x = place(name, host)
    if hasattr(x, "block_until_ready"):
        x.block_until_ready()
    return x


def params_from_tensors(flat: dict[str, np.ndarray], cfg, tokenizer_map=None, *,
                        place: Callable[[str, np.ndarray], Any] | None = None) -> dict:
    """Reference tensors -> the model's parameter pytree, with the load-time conversions
    (docs/architecture.md, "Checkpoint format and load-time conversions"): experts stacked
    (packed FP4 kept), ``wo_a`` dequantised to bf16, the BF16-stored fp32 tensors upcast (head,
    ratio-2 compressor). Validates names, shapes and dtypes first (``ValueError`` naming the
    first missing or mis-shaped tensor).

    ``flat``: name -> numpy array in its storage dtype (:func:`read_checkpoint`,
    ``random_weights.random_tensors``); ``place(name, host_array)`` puts one tensor on the
    device (default :func:`default_place`). For a checkpoint on disk use :func:`load_params`,
    which streams.
    """
    validate_tensors(flat, cfg)
    place = place or default_place

    def stack(name, names):
        return _placed(place, name, np.stack([flat[n] for n in names]))

    return _assemble(cfg, flat, lambda n: _placed(place, n, flat[n]), stack, tokenizer_map)


#: Default ``block_bytes`` of :func:`stream_params`: the most host memory one placement takes.
BLOCK_BYTES = 1 << 30


def _write_rows(out, block, lo):
    """``out`` with rows ``lo .. lo + len(block)`` replaced by ``block``, in place (donated)."""
    import jax
    global _WRITE_ROWS
    if _WRITE_ROWS is None:
        _WRITE_ROWS = jax.jit(lambda o, b, i: jax.lax.dynamic_update_slice_in_dim(o, b, i, 0),
                              donate_argnums=0)
    return _WRITE_ROWS(out, block, lo)


_WRITE_ROWS = None


def _place_in_blocks(place, name: str, shape: tuple, dtype, rows_of, block_bytes: int):
    """Place a ``shape`` tensor whose host rows ``rows_of(lo, hi)`` (leading axis) builds, in
    blocks of at most ``block_bytes`` (at least one row): the whole tensor in one call when it
    fits, else each block placed and written into a device array of the full shape (made with
    the first block's sharding; in host memory, built and written on the host:
    :func:`_host_rows_writer`), so that the host holds one block at a time."""
    import jax.numpy as jnp

    n = shape[0] if shape else 1
    row_bytes = max(1, math.prod(shape[1:]) * np.dtype(dtype).itemsize)
    step = max(1, block_bytes // row_bytes)
    if not shape or step >= n:
        return _placed(place, name, rows_of(0, n))
    out = write = None
    for lo in range(0, n, step):
        block = _placed(place, name, rows_of(lo, min(lo + step, n)))
        if out is None and in_host_memory(block):
            out, write = _host_rows_writer(shape, block)
        elif out is None:
            out, write = jnp.zeros(shape, block.dtype, device=block.sharding), _write_rows
        out = write(out, block, lo)
        del block
        out.block_until_ready()
    return out


def in_host_memory(x) -> bool:
    """Whether ``x`` is a ``jax.Array`` placed in a host memory kind (``"pinned_host"``,
    ``"unpinned_host"``), not in the device's memory."""
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind is not None and kind != "device"


def _host_rows_writer(shape: tuple, block):
    """``(out, write)`` for a tensor built in host memory (an Engram table placed with
    ``engram="host"``): ``out`` zeros of ``shape`` in ``block``'s sharding and ``write(out,
    block, lo)`` :func:`_write_rows`, both computed on the host (``compute_on
    ("device_host")``), so the tensor never passes through the device's memory."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compute_on import compute_on

    host = jax.memory.Space.Host
    on_host = compute_on(compute_type="device_host", out_memory_spaces=host)
    zeros = jax.jit(lambda: on_host(lambda: jnp.zeros(shape, block.dtype))(),
                    out_shardings=block.sharding)
    write = jax.jit(lambda o, b, i: on_host(lambda o, b, i: jax.lax.dynamic_update_slice_in_dim(
        o, b, i, 0))(o, b, jax.device_put(i, host)), out_shardings=block.sharding,
        donate_argnums=0)
    return zeros(), write


def _place_parts(name: str, shape: tuple, dtype, read_part, where, block_bytes: int):
    """A ``jax.Array`` of global ``shape`` placed by ``where`` (a
    :class:`jax.sharding.Sharding`), built part by part: each addressable device's part
    (``where.addressable_devices_indices_map``) is read with ``read_part(bounds)`` (host rows,
    ``((start, stop), ...)`` per dimension, :func:`slice_bounds`), in blocks of at most
    ``block_bytes`` along its leading axis (:func:`_place_in_blocks`), put on that device alone
    and dropped before the next read; ``jax.make_array_from_single_device_arrays`` joins the
    parts. The host holds one block of one part at a time. (Not
    ``jax.make_array_from_callback``: it reads every addressable part before placing any, a
    whole tensor per host - a replicated one once per device.)"""
    import jax

    arrays = []
    for device, index in where.addressable_devices_indices_map(shape).items():
        bounds = slice_bounds(index, shape)
        part = tuple(hi - lo for lo, hi in bounds)

        def rows_of(lo, hi, bounds=bounds):
            if not bounds:
                return read_part(bounds)
            first = bounds[0][0]
            return read_part(((first + lo, first + hi),) + bounds[1:])

        one = jax.sharding.SingleDeviceSharding(device, memory_kind=where.memory_kind)
        arrays.append(_place_in_blocks(lambda n, h, one=one: jax.device_put(h, one), name,
                                       part, dtype, rows_of, block_bytes))
    return jax.make_array_from_single_device_arrays(shape, where, arrays)


def _padded_reader(read_part, shape: tuple):
    """``read_part`` for a tensor of ``shape`` extended to larger global shapes with zero
    rows (the Engram tables padded to a multiple of the device count): the part's rows at or
    past ``shape[0]`` are zeros, the rest read."""
    def read(bounds):
        (lo, hi), rest = bounds[0], bounds[1:]
        real = read_part(((min(lo, shape[0]), min(hi, shape[0])),) + rest)
        if hi <= shape[0]:
            return real
        pad = np.zeros((hi - max(lo, shape[0]),) + real.shape[1:], real.dtype)
        return np.concatenate([real, pad])
    return read


def stream_params(path: str | os.PathLike, cfg, tokenizer_map=None, *,
                  place: Callable[[str, np.ndarray], Any] | None = None,
                  block_bytes: int = BLOCK_BYTES, mesh=None,
                  engram: str = "replicated") -> dict:
    """:func:`params_from_tensors` of a checkpoint on disk (directory of ``*.safetensors`` or
    one file), streamed: the files' headers are checked against the expected layout first
    (:func:`validate_index`, no data read), then each tensor is read as a zero-copy memmap
    view of its bytes (:func:`map_tensor`), placed with ``place(name, host_array)`` (default
    :func:`default_place`), waited for and dropped before the next one. The routed experts of
    one layer and projection are copied into one host buffer ``[E, ...]`` and placed together.

    A tensor (or expert stack) above ``block_bytes`` is placed in blocks of rows along its
    leading axis (``place`` then sees each block under the tensor's name) written into a device
    array of the full shape: the release's Engram tables (98 GB each) and expert stacks (2.3 GB)
    never sit whole in host memory. Peak host memory: about ``min(block_bytes, largest
    tensor)`` plus the pages of the tensor being read, whatever the checkpoint's size.

    ``mesh`` (:func:`dsv41_jax.sharding.make_mesh`): sliced loading. Each tensor (expert
    stack) is made a global array on the mesh in the sharding of the prepared leaf it becomes
    (:func:`dsv41_jax.sharding.checkpoint_sharding`: the table's rule on its path within the
    layer; the Engram tables' rows as ``engram`` says, with ``"host"`` split over the devices
    in their host memory, never passing through the devices' memory); each device's part is
    read alone (:func:`read_slice`: only
    its byte ranges) and put on that device (:func:`_place_parts`), so the host holds about
    one part of one tensor (at most ``block_bytes``), never the tensor. Slicing is done in
    the checkpoint's layout: the FP8 / FP4 weights and their E8M0 scales are each sliced by
    their own rule (a scale's dimension split only where the mesh divides it, on 32-row block
    boundaries; else replicated), and the load-time conversions, then
    :func:`dsv41_jax.model.prepare_params` (stacking, dequantising), run on the device on
    these global arrays: the same values as the unsharded load, bit for bit. Place the
    prepared tree with ``shard_params(..., reshard=True)``. ``place`` is then not used.

    Raises ``ValueError`` naming the tensor and its file for a missing tensor, a wrong shape
    or dtype, a truncated file or one shortened while loading, a tensor in two files, and
    anything :func:`read_header` refuses; ``ValueError`` for a ``block_bytes`` below 1, for
    ``place`` and ``mesh`` both given, and as :func:`~dsv41_jax.sharding.shard_params` for a
    bad mesh or ``engram``.
    """
    if not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes must be an integer >= 1, got {block_bytes!r}")
    if mesh is not None:
        from dsv41_jax import sharding
        if place is not None:
            raise ValueError("place and mesh are exclusive: with a mesh each tensor is placed "
                             "by its sharding")
        sharding.check_mesh(mesh)
        sharding.check_experts(cfg, mesh)
        sharding.logical_axes_table(engram)
    index = checkpoint_index(path)
    validate_index(index, cfg)
    place = place or default_place

    def placed(name, shape, dtype, rows_of, read_part):
        """One tensor read and placed: by ``place`` in blocks of ``rows_of(lo, hi)`` (zero-copy
        views where it can), or on the mesh part by part (``read_part(bounds)``)."""
        if mesh is None:
            return _place_in_blocks(place, name, shape, dtype, rows_of, block_bytes)
        full, where = sharding.checkpoint_sharding(name, shape, mesh, engram=engram)
        if full != shape:
            read_part = _padded_reader(read_part, shape)
        return _place_parts(name, full, dtype, read_part, where, block_bytes)

    def fetch(name):
        e = index[name]

        def rows_of(lo, hi):
            if not e.shape:
                return map_tensor(e)
            row = e.nbytes // e.shape[0] if e.shape[0] else 0
            return map_tensor(dataclasses.replace(
                e, shape=(hi - lo,) + e.shape[1:], start=e.start + lo * row,
                nbytes=(hi - lo) * row))
        return placed(name, e.shape, e.dtype, rows_of, lambda bounds: read_slice(e, bounds))

    def stack(name, names):
        first = index[names[0]]
        whole = tuple((0, n) for n in first.shape)

        def read_part(bounds):
            (lo, hi), rest = bounds[0], bounds[1:]
            buf = np.empty((hi - lo,) + tuple(b - a for a, b in rest), first.dtype)
            for i in range(lo, hi):
                buf[i - lo] = read_slice(index[names[i]], rest)
            return buf
        return placed(name, (len(names),) + first.shape, first.dtype,
                      lambda lo, hi: read_part(((lo, hi),) + whole), read_part)

    return _assemble(cfg, index, fetch, stack, tokenizer_map)


def load_params(path: str | os.PathLike, cfg=None, *, tokenizer_map=None,
                place: Callable[[str, np.ndarray], Any] | None = None,
                block_bytes: int = BLOCK_BYTES, mesh=None, engram: str = "replicated"):
    """Load a reference-format checkpoint directory (``config.json`` + ``*.safetensors``),
    streamed tensor by tensor (:func:`stream_params`).

    Returns ``(cfg, params)``; ``cfg`` defaults to the directory's ``config.json``.
    ``tokenizer_map``: Engram's compressed token map (default: built from the tokenizer);
    ``place``, ``block_bytes``, ``mesh``, ``engram``: see :func:`stream_params` (with a
    ``mesh``, each device reads only its part of each tensor). Raises ``ValueError`` naming a
    missing, mis-shaped or mis-typed tensor and its file, or a truncated file.
    """
    from dsv41_jax.config import ModelConfig

    if cfg is None:
        cfg = ModelConfig.from_json(os.path.join(path, "config.json"))
    return cfg, stream_params(path, cfg, tokenizer_map, place=place, block_bytes=block_bytes,
                              mesh=mesh, engram=engram)
