"""Request bodies read as strict JSON: UTF-8 text (RFC 8259 section 8.1), no NaN or Infinity,
and no string that holds a lone surrogate.

A lone surrogate (the escape "\\ud800" alone, or the bytes ED A0 80 that CESU-8 and WTF-8 write
for it) is half of a UTF-16 pair, no character: no tokenizer can encode it. It is refused with a
400 that names where it sits (`param`), whatever the field, before any route sees the body.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

_SURROGATE = re.compile("[\ud800-\udfff]")
Path = tuple[str | int, ...]


class BodyError(HTTPException):
    """The body cannot be read as JSON text (HTTP 400); `param` names the field, if one."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(400, message)
        self.param = param


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = parse_json(await self.body())
        return self._strict_json


class StrictJsonRoute(APIRoute):
    """A route whose body is read by parse_json: FastAPI passes a BodyError on as it is."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler


def parse_json(body: bytes) -> Any:
    try:
        value = json.loads(_text(body), parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise BodyError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BodyError("the request body is not valid JSON: it is nested too deeply") from None
    found = lone_surrogate(value)
    if found is not None:
        path, text, is_key = found
        raise BodyError(_surrogate_message(path, text, is_key=is_key), param=_dotted(path))
    return value


def _text(body: bytes) -> str:
    """The body as text. Encoded surrogates (ED A0 80) decode to lone surrogates, so that
    lone_surrogate names their field; any other byte that is not UTF-8 refuses the body here."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        first = e
    try:
        return body.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        byte = body[first.start]
        raise BodyError(
            f"the request body is not valid UTF-8: byte 0x{byte:02x} at offset {first.start} "
            f"({first.reason}); JSON text must be UTF-8"
        ) from None


def _refuse_constant(name: str) -> Any:
    raise BodyError(f"the request body is not valid JSON: {name} is not a JSON value")


def lone_surrogate(value: Any) -> tuple[Path, str, bool] | None:
    """The first string (value or object key) holding a lone surrogate: its path, the string
    and whether it is a key. Iterative: the depth is whatever the JSON parser accepted."""
    todo: list[tuple[Path, Any]] = [((), value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path, item, False
        elif isinstance(item, dict):
            for key in item:
                if _SURROGATE.search(key):
                    return path, key, True
            todo.extend(((*path, key), v) for key, v in reversed(item.items()))
        elif isinstance(item, list):
            todo.extend(((*path, i), v) for i, v in reversed(list(enumerate(item))))
    return None


def _surrogate_message(path: Path, text: str, *, is_key: bool) -> str:
    match = _SURROGATE.search(text)
    assert match is not None
    where = _dotted(path)
    what = "a key of " + (where or "the body") if is_key else where or "the body"
    return (
        f"{what}: the text holds a lone surrogate U+{ord(match.group()):04X} at character "
        f"{match.start()}: expected UTF-8 text (a surrogate is half of a UTF-16 pair, no "
        "character)"
    )


def _dotted(path: Path) -> str | None:
    return ".".join(str(p) for p in path) or None
