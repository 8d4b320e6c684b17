"""Strings that reach the database.

PostgreSQL's text types cannot hold NUL (U+0000): a value carrying one fails when it is stored or even
compared in a query. JSON's "\ud800" escapes decode to lone surrogates, which are not Unicode text and which
no database driver can encode. Such values are refused where they enter, by name, on every database alike.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

NUL = "\x00"


def refuse_unstorable(value: str) -> str:
    if NUL in value:
        raise ValueError("must not contain NUL (\\u0000) characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode text: it holds a lone surrogate "
                         f"(U+{ord(value[exc.start]):04X})") from None
    return value


# a string that may be stored or looked up in the database
DbText = Annotated[str, AfterValidator(refuse_unstorable)]
