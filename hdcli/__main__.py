"""`hd` (the console script) and `python -m hdcli`: hd's signal handling (hdcli/interrupts.py) is
in place before the command line's imports begin, so that Ctrl-C or SIGTERM while torch, numpy
or typer import ends hd as it does anywhere else (one line, exit 130 or 143), and stays in place
until the process has ended (interrupts.run)."""
from hdcli import interrupts


def main() -> None:
    interrupts.install()
    from hdcli.cli import main as cli_main
    interrupts.run(cli_main)


if __name__ == "__main__":
    main()
