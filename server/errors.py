"""OpenAI error objects: ``APIError`` and the handlers that render every failure (bad fields,
malformed JSON, unknown route, server fault) as ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger("igserve.api")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = ERROR_TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _param(loc) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def from_validation(exc: ValidationError) -> APIError:
    """The first validation error of a request body, naming its field."""
    err = exc.errors(include_url=False)[0]
    kind, msg = err["type"], err["msg"]
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {msg}", code="invalid_json")
    param = _param(err["loc"]) or (err.get("ctx") or {}).get("param")
    if param is None:
        return APIError(400, f"request body: {msg}")
    if kind == "missing":
        return APIError(400, f"missing required parameter: '{param}'", param=param)
    if kind == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: '{param}'", param=param)
    return APIError(400, f"invalid value for '{param}': {msg}", param=param)


def install(app: FastAPI, count: Callable[[str], None]) -> None:
    """Render every error as an OpenAI error object; ``count(error_type)`` sees each one."""

    def render(err: APIError) -> JSONResponse:
        count(err.type)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return render(exc)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return render(APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return render(APIError(500, "internal server error"))
