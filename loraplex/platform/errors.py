"""Every error leaves the gateway in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Bad input is a 4xx naming the field (`param`); a 500 means a bug or a failed engine, never bad input.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_api_key(message: str = "Incorrect API key provided.") -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"www-authenticate": "Bearer"})


def permission_denied(message: str) -> APIError:
    return APIError(403, message, type="permission_error", code="insufficient_permissions")


def model_not_found(model: str) -> APIError:
    # Another tenant's adapter gets exactly this answer too: never reveal that it exists.
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    code="model_not_found", param="model")


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, code="not_found", param=param)


def conflict(message: str, param: str | None = None) -> APIError:
    return APIError(409, message, code="conflict", param=param)


def too_large(message: str) -> APIError:
    return APIError(413, message, code="request_too_large")


def insufficient_quota(message: str) -> APIError:
    return APIError(429, message, type="insufficient_quota", code="insufficient_quota")


def unavailable(message: str, code: str = "service_unavailable") -> APIError:
    return APIError(503, message, type="server_error", code=code, headers={"retry-after": "1"})


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        message, param = f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    elif tuple(first.get("loc", ())) == ("body",):
        message = "The request body must be a JSON object, sent with `Content-Type: application/json`."
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param).response()


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed"}
    err = APIError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code), headers=exc.headers)
    return err.response()


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return APIError(500, "The server had an error while processing your request.", type="server_error",
                    code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
