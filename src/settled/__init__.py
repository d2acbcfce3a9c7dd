"""settled: completion is a proof, not a status."""

__version__ = "0.1.0"
"""The one place the version is written: the build reads it (pyproject's dynamic version), and
so do `settled --version` and the MCP server, without loading the package metadata."""
