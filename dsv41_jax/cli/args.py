"""Argument parsing shared by the command-line programs: one-line usage errors, checked types."""

from __future__ import annotations

import argparse

from dsv41_jax.sharding import parse_mesh_spec


class Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose usage errors are one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _int_at_least(text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
    return v


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1 (``ArgumentTypeError`` otherwise)."""
    return _int_at_least(text, 1)


def positive_ints(text: str) -> list[int]:
    """An ``argparse`` type: a comma list of integers >= 1, at least one."""
    vals = [positive_int(x) for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of integers >= 1")
    return vals


def nonnegative_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 0 (``ArgumentTypeError`` otherwise)."""
    return _int_at_least(text, 0)


def mesh_spec(text: str) -> dict[str, int]:
    """An ``argparse`` type: a mesh ``data=D,tensor=T,expert=E``
    (:func:`dsv41_jax.sharding.parse_mesh_spec`; ``ArgumentTypeError`` otherwise). Returns the
    axis sizes; the mesh is made when the program runs (``sharding.make_mesh(**sizes)``)."""
    try:
        return parse_mesh_spec(text, flag=None)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
