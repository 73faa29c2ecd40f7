"""Command-line programs of the package (``dsv41-generate``, ...): argument parsing, validation
and reporting around the public API. Each module has a ``main(argv=None) -> int``."""
