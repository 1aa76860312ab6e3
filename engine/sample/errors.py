"""The error of a request the engine refuses."""


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says which field and what to change."""
