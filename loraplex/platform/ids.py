"""The range of row ids.

Row ids are INTEGER columns (PostgreSQL's int4): a number past MAX_ROW_ID names no row, and binding one past
2**63 makes SQLite raise OverflowError. Ids from outside (paths, queries, forms, the CLI) are checked against
it first. Kept free of imports so the CLI can use it without loading the database layer.
"""

MAX_ROW_ID = 2**31 - 1
