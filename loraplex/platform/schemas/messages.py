"""Pydantic's validation errors in words an operator can act on, for the console, the CLI and the admin API.

Pydantic says `String should match pattern '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'` or `Value error, ...`: right for
a developer, not for someone naming a tenant. Here a field is named in words ("requests per minute"), a pattern
by the rule it stands for, and a custom check's message comes without pydantic's "Value error," prefix."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from loraplex.platform.schemas.tenants import NAME_PATTERN

# The rule each pattern used in the schemas stands for; a pattern not listed here is never quoted either.
PATTERN_RULES = {
    NAME_PATTERN: "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
    r"^\d{4}-(0[1-9]|1[0-2])$": "must be a month written YYYY-MM, like 2026-12",
    r"^\d{4}-\d{2}$": "must be a month written YYYY-MM, like 2026-12",
    r"^[A-Z]{3}$": "must be a three-letter currency code, like USD",
    "^(system|user|assistant)$": "must be system, user or assistant",
}

# Pydantic's parts of a location that name no field: the request part, the branches of a union
_NOT_A_FIELD = ("body", "query", "path", "header")


def field_label(loc: tuple[Any, ...] | list[Any]) -> str:
    """A field's location in words: ("body", "requests_per_minute") -> "requests per minute", ("scopes", 0)
    -> "scopes (item 1)"."""
    words = []
    for part in loc:
        if isinstance(part, int):
            words.append(f"(item {part + 1})")
        elif part not in _NOT_A_FIELD and "[" not in str(part):
            words.append(str(part).replace("_", " "))
    return " ".join(words)


def plain_rule(error: dict[str, Any]) -> str:
    """The rule an error broke, in plain words, starting with a verb: "must be at least 1"."""
    kind, ctx = error.get("type", ""), error.get("ctx") or {}
    msg = str(error.get("msg", "is not valid"))
    if kind == "string_pattern_mismatch":
        return PATTERN_RULES.get(ctx.get("pattern"), "is not in the form it must have")
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a field here"
    if kind == "string_unicode":
        # a JSON escape "\ud800" decodes to a lone surrogate, which a constrained string field cannot take;
        # worded as the unconstrained fields' own check words it (loraplex.platform.schemas.text)
        value = error.get("input")
        lone = next((c for c in value if 0xD800 <= ord(c) <= 0xDFFF), None) if isinstance(value, str) else None
        return "is not valid Unicode text: it holds a lone surrogate" + (f" (U+{ord(lone):04X})" if lone else "")
    if kind == "string_too_long":
        length = len(error["input"]) if isinstance(error.get("input"), str) else None
        got = f" (this one has {length})" if length is not None else ""
        return f"must be at most {ctx.get('max_length')} characters long{got}"
    if kind == "string_too_short":
        least = ctx.get("min_length")
        return "must not be empty" if least == 1 else f"must be at least {least} characters long"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = next(iter(ctx.values()), "")
        words = {"greater_than_equal": "at least", "greater_than": "more than", "less_than_equal": "at most",
                 "less_than": "less than"}[kind]
        return f"must be {words} {bound:,}" if isinstance(bound, int) else f"must be {words} {bound}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "must be a whole number"
    if msg.startswith("Input should be "):
        return "must be " + msg.removeprefix("Input should be ")
    return msg[:1].lower() + msg[1:]


def plain_error(error: dict[str, Any]) -> str:
    """"requests per minute must be at least 1"; a custom check's own sentence after the field's name and a
    colon ("name: a tenant name must not be digits only ...")."""
    label = field_label(error.get("loc", ()))
    rule = plain_rule(error)
    if not label:
        return rule[:1].upper() + rule[1:]
    return f"{label}: {rule}" if error.get("type") == "value_error" else f"{label} {rule}"


def plain_errors(exc: ValidationError) -> str:
    """Every problem of a validation error, in words, joined with "; "."""
    return "; ".join(dict.fromkeys(plain_error(e) for e in exc.errors()))
