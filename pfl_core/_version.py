"""pfl's version (a leaf module: anything may import it)."""

__version__ = "0.2.0"
