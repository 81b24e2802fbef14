"""OpenAI-style errors: every failure the client can cause is a 4xx with
``{"error": {"message", "type", "param", "code"}}``, never a 500."""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_exceeded", 500: "internal_server_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    """Raise anywhere in a handler; becomes the HTTP status and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(err: OpenAIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        param = None
    else:
        # a validator's ValueError reads "Value error, <its message>": the message is enough
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: "
                        f"{str(e.get('msg')).removeprefix('Value error, ')} "
                        f"(got {e.get('input')!r:.80})" for e in errors[:3])
    return error_response(OpenAIError(400, msg, param=param, code="invalid_value"))


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(OpenAIError(exc.status_code, str(exc.detail)))


def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc)


def install_error_handlers(app) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
