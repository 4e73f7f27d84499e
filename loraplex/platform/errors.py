"""Every error leaves the gateway in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Bad input is a 4xx naming the field (`param`); a 500 means a bug or a failed engine, never bad input.
"""

from __future__ import annotations

import logging
import math
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class UnsupportedParameter(ValueError):
    """A field of OpenAI's API that loraplex does not honour, sent with a value that would change the answer
    (raised in a request model's validator): 400 with code `unsupported_parameter`, OpenAI's code for a
    parameter a model does not take."""


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


def unavailable(message: str, code: str = "service_unavailable", retry_after_s: float = 1.0) -> APIError:
    """503 for a fault of ours that a retry may not meet (the client should retry after `retry-after`)."""
    return APIError(503, message, type="server_error", code=code, headers=_retry_after(retry_after_s))


def adapter_load_failed(adapter: str, reason: str) -> APIError:
    """503 for a tenant's adapter whose files cannot be loaded (missing, or damaged since upload)."""
    return unavailable(f"The adapter `{adapter}` could not be loaded: {reason}", code="adapter_load_failed")


def overloaded(message: str, code: str = "server_overloaded", retry_after_s: float = 1.0) -> APIError:
    """503 for load shed by design (Envoy's and Kong's answer before a backend melts): nothing ran."""
    return APIError(503, message, type="server_overloaded", code=code, headers=_retry_after(retry_after_s))


def shutting_down() -> APIError:
    return unavailable("The server is shutting down; retry shortly (another replica takes it).",
                       code="server_shutting_down")


# How a scale-out client (`scaleout/client.py`) marks the requests of an engine replica that died under
# them: `RequestOutput.error` starts with this and ": ".
REPLICA_LOST = "ReplicaLost"


def replica_lost() -> APIError:
    """503 for a request whose engine replica died while running it (Ray restarts it; a retry goes to a
    live replica)."""
    return unavailable("The engine replica serving this request stopped; retry (another replica takes it).",
                       code="replica_unavailable")


def engine_overloaded(retry_after_s: float = 1.0) -> APIError:
    return overloaded("The engine is at capacity and its queue is full; retry after the time in `retry-after`.",
                      retry_after_s=retry_after_s)


def _retry_after(seconds: float) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(seconds)))}


# pydantic's tags for the member of a union a value was tried against ("str", "list[int]", "TextPart",
# "function-after[...]"): they end the field's path, they are not part of it.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*)$")


def _param(loc: tuple) -> str | None:
    """The field a validation error is about, as a dotted path ("messages.0.content")."""
    parts = []
    for p in loc:
        if p in ("body", "query", "path", "header") and not parts:
            continue
        if isinstance(p, str) and _UNION_TAG.match(p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


def _message(error: dict) -> str:
    """pydantic's message without its "Value error, " prefix (our checks word their own messages)."""
    return error.get("msg", "invalid value").removeprefix("Value error, ")


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = tuple(first.get("loc", ()))
    param = _param(loc)
    if first.get("type") == "json_invalid":
        message, param = f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    elif loc == ("body",) and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        message = "The request body must be a JSON object, sent with `Content-Type: application/json`."
    else:
        message = _message(first)
        top = param.split(".")[0] if param else None
        # as a word: "n" is in "Input should be a valid integer", but that message does not name it
        if top and not re.search(rf"(?<!\w){re.escape(top)}(?!\w)", message):
            message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    unsupported = isinstance(first.get("ctx", {}).get("error"), UnsupportedParameter)
    return APIError(400, message, param=param, code="unsupported_parameter" if unsupported else None).response()


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    message = str(exc.detail)
    if isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body", from json.loads
        message = "The request body is not valid JSON: it is nested too deeply to parse."
    err = APIError(exc.status_code, message, code=codes.get(exc.status_code), headers=exc.headers)
    return err.response()


async def _database_busy(_request: Request, exc: Exception) -> JSONResponse:
    # The pool is sized for the gateway's concurrency and each use is brief, so this is a database that
    # is down or locked for long: ours, and worth a retry.
    logger.error("database unavailable: %s", exc)
    return unavailable("The database is busy or unreachable; try again shortly.", code="database_unavailable").response()


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return APIError(500, "The server had an error while processing your request.", type="server_error",
                    code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(PoolTimeoutError, _database_busy)
    app.add_exception_handler(OperationalError, _database_busy)
    app.add_exception_handler(Exception, _unexpected)
