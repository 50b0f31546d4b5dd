"""The ``vlfast`` command line: one file per command group, each a thin layer over the library."""
