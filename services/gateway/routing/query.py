"""The rule language of ``conditional`` routes (Portkey's, after MongoDB's query operators).

    {"metadata.tier": {"$eq": "gold"}}
    {"params.max_tokens": {"$gt": 512}}
    {"$or": [{"metadata.team": {"$in": ["a", "b"]}}, {"params.temperature": {"$lt": 0.2}}]}
    {"metadata.region": "eu"}                      a bare value means $eq

Paths read the request: ``params.<field>`` (the request body's fields), ``metadata.<key>``
(``x-tokenmill-metadata`` or the body's ``metadata``), ``model``, ``sla_ms``. Several fields, or
several operators on one field, must all hold. A field the request lacks matches only ``$ne``.
``$gt`` and ``$lt`` (and ``$gte``, ``$lte``) compare numbers only; anything else does not match.
Rules are compiled once when the routes file is loaded; a bad rule is a ValueError naming where.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.gateway.routing.request import RouteRequest

Predicate = Callable[[RouteRequest], bool]

_ROOTS = ("params", "metadata")
_SCALARS = ("model", "sla_ms", "expected_output_tokens", "worst_case")
_MISSING = object()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _compare(op: str, operand: Any, where: str) -> Callable[[Any], bool]:
    if op == "$eq":
        return lambda v: v is not _MISSING and v == operand
    if op == "$ne":
        return lambda v: v is _MISSING or v != operand
    if op in ("$in", "$nin"):
        if not isinstance(operand, list):
            raise ValueError(f"{where}: {op} needs a list, got {operand!r}")
        if op == "$in":
            return lambda v: v is not _MISSING and v in operand
        return lambda v: v is _MISSING or v not in operand
    if op in ("$gt", "$lt", "$gte", "$lte"):
        if not _is_number(operand):
            raise ValueError(f"{where}: {op} needs a number, got {operand!r}")
        test = {"$gt": lambda v: v > operand, "$lt": lambda v: v < operand,
                "$gte": lambda v: v >= operand, "$lte": lambda v: v <= operand}[op]
        return lambda v: _is_number(v) and test(v)
    raise ValueError(f"{where}: unknown operator {op!r} (use $eq $ne $in $nin $gt $gte $lt $lte $and $or)")


def _field(path: str, condition: Any, where: str) -> Predicate:
    head = path.split(".", 1)[0]
    if not ((head in _ROOTS and "." in path) or path in _SCALARS):
        raise ValueError(f"{where}: field {path!r} must be params.<name>, metadata.<key> or one of {list(_SCALARS)}")
    if isinstance(condition, dict) and condition and all(isinstance(k, str) and k.startswith("$") for k in condition):
        tests = [_compare(op, operand, f"{where}.{path}") for op, operand in condition.items()]
    else:
        tests = [_compare("$eq", condition, f"{where}.{path}")]

    def predicate(request: RouteRequest) -> bool:
        found, value = request.lookup(path)
        value = value if found else _MISSING
        return all(test(value) for test in tests)

    return predicate


def compile_query(query: Any, where: str) -> Predicate:
    """A predicate over requests from one rule; ValueError names ``where`` for a bad rule."""
    if not isinstance(query, dict) or not query:
        raise ValueError(f"{where}: a rule must be a non-empty object, got {query!r}")
    parts: list[Predicate] = []
    for key, value in query.items():
        if key in ("$and", "$or"):
            if not isinstance(value, list) or not value:
                raise ValueError(f"{where}: {key} needs a non-empty list of rules")
            subs = [compile_query(q, f"{where}.{key}[{i}]") for i, q in enumerate(value)]
            parts.append((lambda s: lambda r: all(p(r) for p in s))(subs) if key == "$and"
                         else (lambda s: lambda r: any(p(r) for p in s))(subs))
        elif isinstance(key, str) and key.startswith("$"):
            raise ValueError(f"{where}: {key!r} is not a rule operator here (only $and and $or combine rules)")
        else:
            parts.append(_field(key, value, where))
    if len(parts) == 1:
        return parts[0]
    return lambda request: all(p(request) for p in parts)
