"""nmt: train, decode, evaluate and compare neural machine translation models."""

__version__ = "0.1.0"


class NMTError(Exception):
    """An error the user caused and can fix: the CLI prints it as one line and exits 2."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a
    one-line NMTError quotes of a library's error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
