"""Pydantic shapes of the public API, per the schema ladder: XBase -> XCreate / XUpdate -> XPublic."""
