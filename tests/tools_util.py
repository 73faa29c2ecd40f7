"""Load a script of ``tools/`` (not a package) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import os

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")


def load_tool(name: str):
    """The module ``tools/<name>.py``, executed under the name ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
