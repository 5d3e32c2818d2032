"""The `nmt` command (its script and `python -m nmt`): relaunches on the allocator nmt runs on
(`nmt.allocator`) before it imports the command line, whose typer and rich the first process
would otherwise import for nothing (0.3-0.4 s of every command on a 2-core Zen 4)."""

import contextlib

from nmt import NMTError, allocator


def main() -> None:
    with contextlib.suppress(NMTError):  # a wrong NMT_MALLOC: nmt.cli.main says what is wrong
        allocator.relaunch()
    from nmt.cli import main as command_line

    command_line()


if __name__ == "__main__":
    main()
