"""Errors the user can act on. Entry points turn them into a one-line message (CLI exit status 2,
HTTP 400); anything else is a bug and keeps its traceback."""


class UserInputError(ValueError):
    """Invalid input from the user: a bad option, prompt, path or request."""
