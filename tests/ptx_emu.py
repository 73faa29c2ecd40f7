"""A bit-exact numpy emulation of the PTX instructions our inline-asm templates use.

The templates (the sparse attention's FP8/FP4 decode, the FP4 codec's e2m1 encode) only run on
an NVIDIA GPU; this lets the CPU tests check their arithmetic on many inputs at once. Registers
are uint32 numpy arrays (or Python ints), one lane per emulated thread.
"""

from __future__ import annotations

import fractions
import re

import ml_dtypes
import numpy as np

U32 = np.uint32
E4M3 = ml_dtypes.float8_e4m3fn


def bf16_values(bits) -> np.ndarray:
    """bf16 bit patterns (the low 16 bits of ``bits``) -> exact fp32 values."""
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def bf16_bits(x) -> np.ndarray:
    """fp32 values that are exact in bf16 -> their 16-bit patterns (uint32)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).astype(U32)


def _halves(x):
    x = np.asarray(x, U32)
    return x & U32(0xFFFF), x >> U32(16)


def f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def _f32_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _round_f32(q: fractions.Fraction) -> np.float32:
    """The float32 nearest to the exact rational ``q``, ties to even (no double rounding)."""
    x = np.float32(float(q))
    cands = [np.nextafter(x, np.float32(-np.inf)), x, np.nextafter(x, np.float32(np.inf))]
    cands = [c for c in cands if np.isfinite(c)]
    dist = [abs(fractions.Fraction(float(c)) - q) for c in cands]
    best = min(dist)
    ties = [c for c, d in zip(cands, dist) if d == best]
    return min(ties, key=lambda c: int(np.array(c).view(np.uint32)) & 1)


def _fma_f32(a, b, c) -> np.ndarray:
    """fma.rn.f32 on float32 arrays of finite values: one rounding of the exact a*b + c."""
    a, b, c = np.broadcast_arrays(*(np.asarray(v, np.float32) for v in (a, b, c)))
    out = np.empty(a.shape, np.float32)
    for i in np.ndindex(a.shape):
        exact = (fractions.Fraction(float(a[i])) * fractions.Fraction(float(b[i]))
                 + fractions.Fraction(float(c[i])))
        out[i] = _round_f32(exact)
    return out


def _lop3(a, b, c, lut: int):
    """Every output bit is ``lut``'s bit number (a << 2 | b << 1 | c) of the input bits."""
    out = np.zeros(np.broadcast(a, b, c).shape, U32)
    for i in range(8):
        if lut >> i & 1:
            ta = a if i & 4 else ~a
            tb = b if i & 2 else ~b
            tc = c if i & 1 else ~c
            out |= ta & tb & tc
    return out


def run_ptx(asm: str, regs: dict, rcp_ulps: int = 0) -> dict:
    """Run the instructions of ``asm`` (``$n`` operands renamed to keys of ``regs``) on the
    uint32 values of ``regs``; returns ``regs`` with the results. ``rcp.approx`` (whose exact
    bits are the hardware's, within 1 ulp) is emulated as the correctly rounded reciprocal
    moved by ``rcp_ulps`` ulps. Raises ``AssertionError`` for an instruction outside the
    emulated subset or an inexact bf16x2 product."""
    regs = {k: np.asarray(v, U32) for k, v in regs.items()}

    def val(tok):
        tok = tok.strip()
        if tok.startswith("0x"):
            return U32(int(tok, 16))
        if tok.startswith("0f"):                  # a float immediate: its 32 bits in hex
            return U32(int(tok[2:], 16))
        return U32(int(tok)) if tok.isdigit() else regs[tok]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        ops = [t.strip() for t in re.split(r",(?![^{]*})", rest)]
        dst, src = ops[0], ops[1:]
        i32 = lambda t: np.asarray(val(t), U32).view(np.int32)  # noqa: E731
        if op == "setp.gt.s32":
            regs[dst] = i32(src[0]) > i32(src[1])
        elif op in ("max.s32", "min.s32"):
            f = np.maximum if op == "max.s32" else np.minimum
            regs[dst] = f(i32(src[0]), i32(src[1])).view(U32)
        elif op == "mul.rn.f32":
            regs[dst] = _f32_bits(f32(val(src[0])) * f32(val(src[1])))
        elif op == "neg.f32":
            regs[dst] = np.asarray(val(src[0]), U32) ^ U32(0x80000000)
        elif op == "rcp.approx.ftz.f32":
            y = np.float32(1.0) / f32(val(src[0]))
            for _ in range(abs(rcp_ulps)):
                y = np.nextafter(y, np.float32(np.inf if rcp_ulps > 0 else -np.inf))
            regs[dst] = _f32_bits(y)
        elif op == "fma.rn.f32":
            regs[dst] = _f32_bits(_fma_f32(f32(val(src[0])), f32(val(src[1])),
                                           f32(val(src[2]))))
        elif op == "cvt.rn.satfinite.e4m3x2.f32":        # d.hi = cvt(a), d.lo = cvt(b)
            def e4m3(x):
                x = f32(x)
                x = np.where(np.isnan(x), x, np.clip(x, -448.0, 448.0)).astype(np.float32)
                return x.astype(E4M3).view(np.uint8).astype(U32)
            regs[dst] = e4m3(val(src[0])) << U32(8) | e4m3(val(src[1]))
        elif op == "selp.b16" or op == "selp.b32":
            regs[dst] = np.where(regs[src[2]], val(src[0]), val(src[1])).astype(U32)
        elif op == "cvt.u32.u16":
            regs[dst] = np.asarray(val(src[0]), U32) & U32(0xFFFF)
        elif op == "cvt.u16.u32":
            regs[dst] = np.asarray(val(src[0]), U32) & U32(0xFFFF)
        elif op == "cvt.rn.f16x2.e4m3x2":                # each byte -> its f16, exactly
            b = np.asarray(val(src[0]), U32)
            half = [((b >> U32(8 * i)) & U32(0xFF)).astype(np.uint8).view(E4M3)
                    .astype(np.float16).view(np.uint16).astype(U32) for i in (0, 1)]
            regs[dst] = half[0] | half[1] << U32(16)
        elif op == "cvt.f32.f16":
            h = (np.asarray(val(src[0]), U32) & U32(0xFFFF)).astype(np.uint16)
            regs[dst] = _f32_bits(h.view(np.float16).astype(np.float32))
        elif op == "cvt.rn.bf16x2.f32":                  # d.hi = bf16(a), d.lo = bf16(b)
            regs[dst] = (bf16_bits(f32(val(src[0]))) << U32(16)) | bf16_bits(f32(val(src[1])))
        elif op == "prmt.b32":
            a, b, sel = (np.asarray(val(t), U32) for t in src)
            by = [(a >> U32(8 * i)) & U32(0xFF) for i in range(4)] + \
                 [(b >> U32(8 * i)) & U32(0xFF) for i in range(4)]
            out = np.zeros(np.broadcast(a, b).shape, U32)
            for i in range(4):
                k = int(sel) >> 4 * i & 7
                out |= by[k] << U32(8 * i)
            regs[dst] = out
        elif op == "shr.u32":
            regs[dst] = val(src[0]) >> val(src[1])
        elif op == "shl.b32":
            regs[dst] = val(src[0]) << val(src[1])
        elif op in ("and.b32", "or.b32", "xor.b32"):
            a, b = val(src[0]), val(src[1])
            regs[dst] = {"and.b32": a & b, "or.b32": a | b, "xor.b32": a ^ b}[op]
        elif op == "mov.b32" and dst.startswith("{"):   # unpack: {lo, hi} = the halves
            lo, hi = (t.strip() for t in dst.strip("{}").split(","))
            regs[lo], regs[hi] = _halves(val(src[0]))
        elif op == "mov.b32":
            regs[dst] = np.asarray(val(src[0]), U32)
        elif op == "cvt.rn.bf16.f32":                    # round to nearest even
            regs[dst] = bf16_bits(f32(val(src[0])))
        elif op == "lop3.b32":
            regs[dst] = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 16))
        elif (m := re.fullmatch(r"set\.(gt|ge|lt|le|eq)\.u32\.bf16x2", op)):
            cmp = {"gt": np.greater, "ge": np.greater_equal, "lt": np.less,
                   "le": np.less_equal, "eq": np.equal}[m.group(1)]
            out = 0
            for sh, ha, hb in zip((0, 16), _halves(val(src[0])), _halves(val(src[1]))):
                hit = cmp(bf16_values(ha), bf16_values(hb))       # NaN compares false
                out = out | (np.where(hit, U32(0xFFFF), U32(0)) << U32(sh))
            regs[dst] = np.asarray(out, U32)
        elif op == "mul.rn.bf16x2":
            out = 0
            for sh, ha, hb in zip((0, 16), _halves(val(src[0])), _halves(val(src[1]))):
                prod = bf16_values(ha) * bf16_values(hb)
                bits = bf16_bits(prod)
                assert np.array_equal(bf16_values(bits), prod, equal_nan=True), \
                    "inexact bf16 product"
                out = out | (bits << U32(sh))
            regs[dst] = np.asarray(out, U32)
        else:
            raise AssertionError(f"instruction not emulated: {op}")
    return regs
