"""The range of row ids.

Row ids are INTEGER columns (PostgreSQL's int4): a number past MAX_ROW_ID names no row, and binding one past
2**63 makes SQLite raise OverflowError. Ids from outside (paths, queries, forms, the CLI) are checked against
it first. Kept free of imports so the CLI can use it without loading the database layer.
"""

MAX_ROW_ID = 2**31 - 1


def parse_row_id(text: str | None) -> int | None:
    """A row id written out (a query or form value), or None when `text` is not one: ASCII digits only
    (int() would also take "١٢" or "1_000"), no more than MAX_ROW_ID, read without converting thousands
    of digits."""
    if not text or not (text.isascii() and text.isdigit()) or len(text) > len(str(MAX_ROW_ID)):
        return None
    value = int(text)
    return value if 1 <= value <= MAX_ROW_ID else None
