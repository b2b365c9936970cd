"""Errors a user's request can cause; each message says what was wrong and what would fit."""


class RequestRejectedError(ValueError):
    """The request can never be served as given; nothing else was disturbed."""


class RequestTooLongError(RequestRejectedError):
    """The prompt (plus the tokens asked for) exceeds ``max_model_len`` or the KV pool."""


class EngineDeadError(RuntimeError):
    """The engine failed and cannot take more requests."""
