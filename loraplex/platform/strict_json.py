"""JSON bodies as the JSON standard has them: Python's json.loads (which Starlette and FastAPI use) also reads
the tokens NaN, Infinity and -Infinity, and a number like 1e999 as infinity, so `"temperature": NaN` would reach
validation and be refused as "out of range", or pass where a field has no bounds. Every router of the service
uses StrictJsonRoute, whose requests refuse those as an unparsable body: the API's usual invalid-JSON error,
naming the token. Each other way a body can fail to be JSON (bytes that are not UTF-8, an integer of thousands
of digits, nesting deeper than the parser goes) gets its own message, and a compressed body a 415.

A body that cannot be read is not refused at once: FastAPI parses the body before it runs a route's
dependencies, which would tell a caller without a valid key how its body was wrong. The failure is kept on the
request and answered once the dependencies (authentication among them) have passed."""

from __future__ import annotations

import codecs
import json
import math
import sys
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from loraplex.platform.errors import BODY_ERROR_SCOPE_KEY, APIError, bad_request


class NotJsonError(json.JSONDecodeError):
    """A JSONDecodeError whose message is the whole story: no line and column appended where none helps."""

    def __init__(self, msg: str, doc: str = "", pos: int = 0):
        ValueError.__init__(self, msg)
        self.msg, self.doc, self.pos = msg, doc, pos
        self.lineno = doc.count("\n", 0, pos) + 1
        self.colno = pos - doc.rfind("\n", 0, pos)


class _ConstantError(ValueError):
    pass


def _refuse_constant(token: str) -> Any:
    raise _ConstantError(token)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _ConstantError(text)
    return value


def _utf8_text(body: bytes) -> str:
    """A body as UTF-8 text (a UTF-8 byte order mark allowed, as RFC 8259 lets parsers allow it). json.loads
    given bytes would guess UTF-16 or UTF-32 from a body's NUL bytes and read it; JSON exchanged between
    systems is UTF-8, and no JSON text holds a NUL byte, so one is refused where it stands. Offsets count
    from the body's first byte."""
    skipped = len(codecs.BOM_UTF8) if body.startswith(codecs.BOM_UTF8) else 0
    try:
        text = body[skipped:].decode("utf-8")
        bad_byte = None
    except UnicodeDecodeError as exc:
        text, bad_byte = "", skipped + exc.start
    nul = body.find(b"\x00", skipped, bad_byte)
    if nul >= 0:
        raise NotJsonError(f"the body is not UTF-8 JSON text: byte 0x00 at byte offset {nul} is a NUL, which JSON "
                           "text never holds (a body in UTF-16 or UTF-32 has them; send JSON encoded as UTF-8)")
    if bad_byte is not None:
        # the position is a byte offset, which no line and column of the text stand for
        raise NotJsonError(f"the body is not UTF-8 text: byte 0x{body[bad_byte]:02x} at byte offset {bad_byte} is "
                           "not valid UTF-8 (send JSON encoded as UTF-8)")
    return text


def loads(text: str | bytes) -> Any:
    """json.loads without NaN and the infinities, of UTF-8 text only; a JSONDecodeError says what is wrong and,
    where it helps, where."""
    try:
        if isinstance(text, bytes):
            text = _utf8_text(text)
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except NotJsonError:
        raise
    except json.JSONDecodeError as exc:
        raise NotJsonError(f"{exc.msg} (line {exc.lineno} column {exc.colno})", exc.doc, exc.pos) from None
    except _ConstantError as exc:
        token = str(exc)
        doc = text if isinstance(text, str) else ""
        what = ("JSON has no NaN or Infinity; send a number" if token in ("NaN", "Infinity", "-Infinity")
                else "the number is too large for a 64-bit float")
        raise NotJsonError(f"{token} is not valid JSON ({what})", doc, max(doc.find(token), 0)) from None
    except RecursionError:
        raise NotJsonError("its arrays and objects are nested too deeply") from None
    except ValueError as exc:
        if "digits" not in str(exc):
            raise
        # int() refuses integer literals past sys.get_int_max_str_digits() (4300 digits by default)
        raise NotJsonError(f"an integer in it has more than {sys.get_int_max_str_digits()} digits, "
                           "too large for any parameter") from None


def refuse_encoded_body(headers: Mapping[str, str]) -> None:
    """The service reads bodies as sent: a Content-Encoding other than identity (gzip, say) is refused."""
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding and encoding != "identity":
        raise APIError(415, f"Compressed request bodies are not accepted (Content-Encoding: "
                            f"{encoding[:40]!r}); send the body uncompressed.", code="unsupported_media_type")


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                refuse_encoded_body(self.headers)
                self._json = loads(await self.body())
            except json.JSONDecodeError as exc:
                self._defer(bad_request(f"We could not parse the JSON body of your request: {exc.msg}"))
            except APIError as exc:
                self._defer(exc)
        return self._json

    def _defer(self, error: APIError) -> None:
        """Answered by the validation error handler, after the route's dependencies: the body stands in as a
        value no body model accepts."""
        self.scope[BODY_ERROR_SCOPE_KEY] = error
        self._json = _UNREADABLE


# what a route's body model is given for a body that could not be read: refused by every model
_UNREADABLE = object()


class StrictJsonRoute(APIRoute):
    """A route whose endpoint, and FastAPI's body parsing for it, see a StrictJsonRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler
