"""Errors the engine raises for a request it can never run."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses at admission; ``param`` names the request field at fault
    ("prompt", "n"), so a server can point its caller at it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
