"""Errors shaped like OpenAI's: {"error": {"message", "type", "param", "code"}} with its status codes."""

from __future__ import annotations

import email.message
import json
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.engine.errors import (
    AdapterLoadError,
    AdapterMissingError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
)

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


REQUEST_TOO_LARGE = "request_too_large"
REQUEST_TIMEOUT = "request_timeout"  # the request's body stopped arriving

# where a route's request keeps the error of a body it could not read (loraplex.platform.strict_json), for the
# validation handler to answer once the route's dependencies have passed
BODY_ERROR_SCOPE_KEY = "loraplex.body_error"


def shown(value: object, limit: int = 80) -> str:
    """A caller's value quoted back in a message, cut to `limit` characters: a request naming a model of a
    megabyte gets an error of a few hundred bytes, not its own body back."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"})


def forbidden(message: str, code: str | None = None) -> APIError:
    return APIError(403, message, type="permission_error", code=code)


def conflict(message: str, param: str | None = None) -> APIError:
    return APIError(409, message, param=param, code="conflict")


def unavailable(message: str, retry_after: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return APIError(503, message, type="server_error", code="service_unavailable", headers=headers)


def from_engine_error(exc: Exception) -> APIError:
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        # the cause (which engine, at which internal address) is for the server log, not for tenants
        return unavailable("No engine can take the request right now (busy, restarting or unreachable); "
                           "retry shortly.", retry_after=1)
    if isinstance(exc, AdapterMissingError):
        # the tenant's own delete (or another process's sweep) took the weights first: nothing the server
        # did wrong, and the same request again gets model_not_found
        return not_found(f"The adapter {exc} was deleted before the request could start.", param="model",
                         code="adapter_deleted")
    if isinstance(exc, AdapterLoadError):
        return APIError(500, f"the adapter could not be loaded: {exc}", type="server_error",
                        code="adapter_load_failed")
    return APIError(500, f"engine error: {exc}", type="server_error")


# The names pydantic gives the branches of a union in an error's location ("str", "list[int]",
# "function-after[refuse_unstorable(), str]"): not part of the parameter's name.
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|dict|list|[\w-]+\[.*\])$")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    parts = parts[:1] + [p for p in parts[1:] if not _UNION_BRANCH.match(p)]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


async def _api_error_handler(request: Request, exc: APIError) -> Response:
    return _as_page(request, exc.response())


# Areas whose pages answer their errors in HTML (the console registers itself): prefix -> (renderer, prefixes
# under it that stay JSON). A renderer takes (request, status, message) and returns the page.
_html_pages: dict[str, tuple[Callable[[Request, int, str], Response], tuple[str, ...]]] = {}


def answer_errors_in_html(prefix: str, renderer: Callable[[Request, int, str], Response],
                          json_under: tuple[str, ...] = ()) -> None:
    _html_pages[prefix] = (renderer, json_under)


def _page_renderer(path: str) -> Callable[[Request, int, str], Response] | None:
    """The renderer of the HTML area `path` is in; None for a path that answers in JSON."""
    for prefix, (renderer, json_under) in _html_pages.items():
        if (path == prefix or path.startswith(prefix + "/")) and not path.startswith(json_under):
            return renderer
    return None


def _as_page(request: Request, response: JSONResponse) -> Response:
    """The JSON error response, or the page that stands for it where the path is an HTML area's."""
    renderer = _page_renderer(request.url.path)
    if renderer is None:
        return response
    message = json.loads(response.body)["error"]["message"]
    page = renderer(request, response.status_code, message)
    for name, value in response.headers.items():
        if name.lower() not in ("content-type", "content-length"):
            page.headers.setdefault(name, value)
    return page


def server_error_page(scope: dict[str, Any], message: str) -> Response | None:
    """A 500 as the page of the HTML area the request was for (a console page a browser asked for); None where
    the request answers in JSON, or where even the page could not be rendered (the JSON error stands then)."""
    return error_page(scope, 500, message)


def error_page(scope: dict[str, Any], status: int, message: str) -> Response | None:
    """An error answered before routing (or a 500) as the page of the HTML area the request was for; None where
    the request answers in JSON, or where even the page could not be rendered (the JSON error stands then)."""
    request = Request(scope)
    renderer = _page_renderer(request.url.path)
    if renderer is None:
        return None
    try:
        return renderer(request, status, message)
    except Exception:
        log.exception("the error page of request %s could not be rendered", scope.get("state", {}).get("request_id"))
        return None


def _plain_msg(error: dict[str, Any]) -> str:
    """Pydantic's message, but a pattern said as the rule it stands for (never a regex), a custom check's
    message without pydantic's "Value error," prefix, and a lone surrogate named as such."""
    if error.get("type") in ("string_pattern_mismatch", "value_error", "string_unicode"):
        from loraplex.platform.schemas.messages import plain_rule

        return plain_rule(error)
    return error.get("msg", "invalid value")


async def _validation_handler(request: Request, exc: RequestValidationError) -> Response:
    body_error = request.scope.get(BODY_ERROR_SCOPE_KEY)
    if isinstance(body_error, APIError):
        return _as_page(request, body_error.response())
    return _as_page(request, _validation_response(exc, request.headers.get("content-type", "")))


def is_json_content_type(content_type: str) -> bool:
    """Whether FastAPI reads a body of this type as JSON: application/json or application/*+json, parameters
    (a charset) allowed."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _validation_response(exc: RequestValidationError, content_type: str = "application/json") -> JSONResponse:
    # OpenAI answers malformed parameters with 400 invalid_request_error naming the parameter.
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return bad_request("We could not parse the JSON body of your request: "
                           f"{first.get('ctx', {}).get('error', 'invalid JSON')}").response()
    msg = _plain_msg(first)
    # a value that fits no branch of a union fails once per branch, all under the same parameter
    same = [e for e in errors if _loc_to_param(tuple(e.get("loc", ()))) == param]
    if param and len(same) > 1:
        msgs = list(dict.fromkeys(_plain_msg(e) for e in same))
        msg = msgs[0] + "".join(f", or {m[0].lower()}{m[1:]}" for m in msgs[1:])
        errors = [first] + [e for e in errors if e not in same]
    if tuple(first.get("loc", ())) == ("body",):  # no body at all, or JSON that is not an object
        if first.get("type") == "missing":
            return bad_request("The request has no body: send a JSON object "
                               "(Content-Type: application/json).").response()
        if not is_json_content_type(content_type):  # sent as text/plain or text/json, say: not read as JSON
            return bad_request("The request body must be a JSON object sent with Content-Type: application/json "
                               f"(this one came as {shown(content_type or 'no content type')!r}).").response()
        return bad_request(f"The request body must be a JSON object: {msg}").response()
    if first.get("type") == "missing" and param:
        message = f"Missing required parameter: '{param}'"
    elif first.get("type") == "extra_forbidden" and param:
        message = f"Unrecognized request argument supplied: '{param}'"
    else:
        message = f"Invalid value for '{param}': {msg}" if param else f"Invalid request: {msg}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param=param).response()


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    return _as_page(request, _http_error_response(exc))


def _http_error_response(exc: StarletteHTTPException) -> JSONResponse:
    kind = {401: "authentication_error", 403: "permission_error"}.get(
        exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error")
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    code = {413: REQUEST_TOO_LARGE, 408: REQUEST_TIMEOUT}.get(exc.status_code)
    return JSONResponse(error_body(detail, kind, code=code), status_code=exc.status_code, headers=exc.headers)


def backing_service_errors() -> tuple[type[Exception], ...]:
    """Errors that mean Redis or the database did not answer (an outage, a restart), as opposed to a bug."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    classes: list[type[Exception]] = [OperationalError, InterfaceError]
    try:
        import redis.exceptions

        classes += [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError]
    except ImportError:
        pass
    return tuple(classes)


async def _backing_service_handler(request: Request, exc: Exception) -> Response:
    """503 with Retry-After, and one log line naming the request, instead of a 500 and a traceback per request
    while Redis or the database is away."""
    request_id = request.scope.get("state", {}).get("request_id", "-")
    source = type(exc).__module__.split(".")[0]
    log.warning("request %s not served: %s did not answer: %s", request_id,
                "the database" if source == "sqlalchemy" else source,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return _as_page(request, unavailable("The service is briefly unavailable (its data store did not answer); "
                                         "retry shortly.", retry_after=2).response())


async def _integrity_handler(request: Request, exc: Exception) -> Response:
    """Two requests made the same row at once (the same plan name, the same period's price) and the database
    kept one: the other is a conflict to retry, not a server error."""
    request_id = request.scope.get("state", {}).get("request_id", "-")
    orig = getattr(exc, "orig", exc)
    if getattr(orig, "pgcode", None) != "23505" and "unique constraint" not in str(orig).lower():
        # not a lost race (a foreign key, a NOT NULL): a bug, answered as any other server error
        log.error("unhandled database error in request %s", request_id, exc_info=exc)
        return _as_page(request, APIError(500, f"The server had an error processing request {request_id}.",
                                          type="server_error").response())
    log.info("request %s lost a race to a concurrent change: %s", request_id, str(orig).splitlines()[0])
    return _as_page(request, conflict("A concurrent request changed the same record; retry the request.").response())


def install_error_handlers(app: FastAPI) -> None:
    from sqlalchemy.exc import IntegrityError

    for cls in backing_service_errors():
        app.add_exception_handler(cls, _backing_service_handler)
    app.add_exception_handler(IntegrityError, _integrity_handler)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
