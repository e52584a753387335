"""Every refusal as OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, with
the status a client expects; the server keeps serving.

A validation error names its field twice: in `param` (`messages.0.content`) and at the start of
the message. Only the first error of a request is told, as OpenAI does.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from moelora.errors import (
    AdapterBusyError,
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    EngineDeadError,
    InvalidRequestError,
    MoeloraError,
)
from moelora.server import protocol
from moelora.server.async_engine import EngineError, ShuttingDownError

log = logging.getLogger("moelora.server")


class PermissionDeniedError(MoeloraError):
    """The server's configuration does not allow this request (HTTP 403)."""


# status, OpenAI error type, code; the most specific class first
ERRORS: list[tuple[type[Exception], int, str, str | None]] = [
    (AdapterNotFoundError, 404, "NotFoundError", "model_not_found"),
    (AdapterBusyError, 409, "ConflictError", "adapter_busy"),
    (AdapterExistsError, 400, "BadRequestError", "adapter_exists"),
    (AdapterError, 400, "BadRequestError", "invalid_adapter"),
    (PermissionDeniedError, 403, "PermissionDeniedError", "permission_denied"),
    (InvalidRequestError, 400, "BadRequestError", None),
    (EngineDeadError, 503, "ServiceUnavailableError", None),  # a MoeloraError, not the user's
    (ShuttingDownError, 503, "ServiceUnavailableError", None),
    (MoeloraError, 400, "BadRequestError", None),
    (EngineError, 500, "InternalServerError", None),
]
# the error type of a status that Starlette or a middleware answers
HTTP_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_NOT_AN_OBJECT = frozenset({"model_type", "model_attributes_type", "dict_type"})
_SHOWN_INPUT = 80  # characters of a refused value quoted in the message


def error_response(
    status: int, message: str, type_: str, *, headers: dict[str, str] | None = None, **kw: Any
) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, type_, **kw), status, headers=headers)


def exception_response(e: Exception) -> JSONResponse:
    status, body = exception_body(e)
    return JSONResponse(body, status)


def exception_body(e: Exception) -> tuple[int, dict[str, Any]]:
    """The status and error JSON of `e`, also for a stream that fails after its first event."""
    for cls, status, type_, code in ERRORS:
        if isinstance(e, cls):
            param = getattr(e, "param", None)
            return status, protocol.error_body(str(e), type_, code=code, param=param)
    log.exception("unexpected error", exc_info=e)
    return 500, protocol.error_body(f"internal error: {e!r}", "InternalServerError")


def validation_response(errors: list[dict[str, Any]]) -> JSONResponse:
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    param = protocol.field_path(loc[1:] if loc[:1] == ("body",) else loc)
    return error_response(400, _message(first, param), "BadRequestError", param=param)


def _message(error: dict[str, Any], param: str | None) -> str:
    kind, text = error.get("type"), error.get("msg", "invalid request")
    if param is None:
        if kind == "missing":
            return "the request body is missing: expected a JSON object"
        if kind in _NOT_AN_OBJECT:
            return f"the request body is not a JSON object: got {_shown(error.get('input'))}"
        return text
    if kind == "missing":
        return f"{param} is missing: this field is required"
    return f"{param}: {text}; got {_shown(error.get('input'))}"


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOWN_INPUT else text[: _SHOWN_INPUT - 3] + "..."


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MoeloraError)
    @app.exception_handler(EngineError)
    @app.exception_handler(ShuttingDownError)
    async def engine_error(_: Request, e: Exception) -> JSONResponse:
        return exception_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return validation_response(list(e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        """Starlette's own (404, 405 with its Allow header) and the body's (json_body)."""
        kind = HTTP_TYPES.get(e.status_code, "Error")
        param = getattr(e, "param", None)
        return error_response(e.status_code, str(e.detail), kind, headers=e.headers, param=param)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        return exception_response(e)
