"""JSON Schema of every control route's request and reply, generated from the msgspec types.

Requests are `ray_ckpt.control.wire`'s types (what the routes decode),
replies `ray_ckpt.control.replies`'; `msgspec.json.schema_components` turns
them into JSON Schema (draft 2020-12) with shared `$defs`.  `ray-ckpt schema`
prints `document()`; `route_schema(name)` is one route, self-contained, for a
client that validates what it sends or receives.

The ID patterns end in Python's `\\Z` (no newline before the end); JSON
Schema's patterns are ECMA-262, which has no `\\Z` and whose `$` never
matches before a trailing newline, so the published patterns end in `$`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ray_ckpt.control import replies, wire
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX
from ray_ckpt.errors import NotFound

DIALECT = "https://json-schema.org/draft/2020-12/schema"
_REF = "#/$defs/{name}"


class Route(msgspec.Struct, frozen=True, kw_only=True):
    """One control route: its method, its request body (none for `status`)
    and the replies it may answer with 200 (several: any one of them)."""

    method: str
    request: type | None
    replies: tuple[type, ...]


ROUTES: dict[str, Route] = {
    "status": Route(method="GET", request=None, replies=(replies.StatusReply,)),
    "prepare": Route(
        method="POST", request=wire.REQUEST_TYPES["prepare"], replies=(replies.PrepareReply,)
    ),
    "renew": Route(
        method="POST", request=wire.REQUEST_TYPES["renew"], replies=(replies.RenewReply,)
    ),
    "commit": Route(
        method="POST",
        request=wire.REQUEST_TYPES["commit"],
        replies=(replies.CommitReply, replies.CommitPendingReply),
    ),
    "restore": Route(
        method="POST", request=wire.REQUEST_TYPES["restore"], replies=(replies.RestoreReply,)
    ),
    "resume": Route(
        method="POST", request=wire.REQUEST_TYPES["resume"], replies=(replies.ResumeReply,)
    ),
    "retire": Route(
        method="POST", request=wire.REQUEST_TYPES["retire"], replies=(replies.RetireReply,)
    ),
    "forget": Route(
        method="POST", request=wire.REQUEST_TYPES["forget"], replies=(replies.ForgetReply,)
    ),
    "ack": Route(
        method="POST",
        request=wire.RECEIPT_REQUEST_TYPES["ack"],
        replies=(replies.AckReply, replies.AckCheckReply),
    ),
    "collect": Route(
        method="POST",
        request=wire.RECEIPT_REQUEST_TYPES["collect"],
        replies=(replies.CollectReply,),
    ),
}


def route_names() -> list[str]:
    return list(ROUTES)


def _route(name: str) -> Route:
    try:
        return ROUTES[name]
    except KeyError:
        raise NotFound(f"no control route {name!r}; the routes are {', '.join(ROUTES)}") from None


def _ecma(node: Any) -> Any:
    """A copy with every `pattern`'s trailing `\\Z` written as ECMA-262's `$`."""
    if isinstance(node, dict):
        out = {k: _ecma(v) for k, v in node.items()}
        pattern = out.get("pattern")
        if isinstance(pattern, str) and pattern.endswith("\\Z"):
            out["pattern"] = pattern[:-2] + "$"
        return out
    if isinstance(node, list):
        return [_ecma(v) for v in node]
    return node


def _one_of(refs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return dict(refs[0]) if len(refs) == 1 else {"anyOf": list(refs)}


def _routes_schema(names: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The routes' entries and the `$defs` they use, from one generation pass
    (so a type used by two routes is one definition)."""
    types: list[type] = [replies.ErrorReply]
    for name in names:
        route = _route(name)
        if route.request is not None:
            types.append(route.request)
        types.extend(route.replies)
    # Same type, same schema: generate each once, keep the order.
    unique = list(dict.fromkeys(types))
    generated, defs = msgspec.json.schema_components(unique, ref_template=_REF)
    ref = dict(zip(unique, generated, strict=True))
    entries: dict[str, Any] = {}
    for name in names:
        route = ROUTES[name]
        entries[name] = {
            "method": route.method,
            "path": f"{CHECKPOINT_ROUTE_PREFIX}/{name}",
            "request": None if route.request is None else ref[route.request],
            "reply": _one_of([ref[t] for t in route.replies]),
            "error": ref[replies.ErrorReply],
        }
    return _ecma(entries), _ecma(defs)


def document() -> dict[str, Any]:
    """Every route's request, reply and error schema, with their shared `$defs`.

    `request` is null for `status` (a GET without a body; `?processes=1`
    adds `accepting_processes` to its reply)."""
    entries, defs = _routes_schema(list(ROUTES))
    return {
        "$schema": DIALECT,
        "title": "ray-ckpt control routes",
        "description": (
            f"Routes under {CHECKPOINT_ROUTE_PREFIX}/, bearer-protected. A 200 reply "
            "matches `reply`; every rejection (4xx/5xx) matches `error`."
        ),
        "routes": entries,
        "$defs": defs,
    }


def route_schema(name: str) -> dict[str, Any]:
    """One route's entry with only the `$defs` it uses; raises `NotFound`."""
    entries, defs = _routes_schema([name])
    return {"$schema": DIALECT, "route": name, **entries[name], "$defs": defs}


def reply_schema(name: str, *, error: bool = False) -> dict[str, Any]:
    """A self-contained schema of one route's 200 reply (or, with `error`, its
    rejection), ready for a JSON Schema validator."""
    entry = route_schema(name)
    return {"$schema": DIALECT, "$defs": entry["$defs"], **entry["error" if error else "reply"]}


def request_schema(name: str) -> dict[str, Any] | None:
    """A self-contained schema of one route's request body (None: no body)."""
    entry = route_schema(name)
    if entry["request"] is None:
        return None
    return {"$schema": DIALECT, "$defs": entry["$defs"], **entry["request"]}
