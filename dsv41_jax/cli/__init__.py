"""Command-line entry points (``[project.scripts]`` in pyproject.toml)."""
