"""qtk's version (pyproject.toml's), read by the package, the server and the gates' cache key."""

__version__ = "0.1.0"
