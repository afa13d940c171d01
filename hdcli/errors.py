"""The one exception users see: its message is printed as a single line and the CLI exits 2."""


class HdError(Exception):
    """A problem with the user's input or environment, with what to do about it."""
