"""Errors a user's request can cause; each message says what was wrong and what would fit."""

from pagedkv.errors import PagedKVError


class RequestRejectedError(PagedKVError, ValueError):
    """The request can never be served as given; nothing else was disturbed. ``param`` names the
    request field at fault when it is not the prompt (e.g. "logit_bias")."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLongError(RequestRejectedError):
    """The prompt (plus the tokens asked for) exceeds ``max_model_len`` or the KV pool."""


class EngineDeadError(PagedKVError, RuntimeError):
    """The engine failed and cannot take more requests."""


class RequestFailedError(PagedKVError, RuntimeError):
    """Processing one request failed (sampling, stop checks, detokenization, or the forward pass
    of its batch); that request ended, and the engine goes on serving the others."""
