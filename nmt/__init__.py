"""nmt: train, decode, evaluate and compare neural machine translation models."""

__version__ = "0.1.0"


class NMTError(Exception):
    """An error the user caused and can fix: the CLI prints it as one line and exits 2."""
