"""Errors returned to HTTP clients in OpenAI's format: the one type every route and the parts it
calls (the request models in protocol.py, the tool parsers in tools/) raise, in a module that imports
nothing of the server, so any of them can use it without an import cycle."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error returned to the client in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
