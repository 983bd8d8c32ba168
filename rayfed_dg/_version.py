"""The package version, in a module of its own so that the engine and the CLI can read it without importing
the package root (whose ``run``/``load`` lead to the engine)."""
__version__ = "0.1.0"
