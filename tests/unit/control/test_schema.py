"""The published JSON Schema (`ray-ckpt schema`): one per route, valid, and
true of the replies the conformance suite does not reach (renew, an
asynchronous commit, ack, collect), taken from a real engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
from click.testing import CliRunner

from coordination.cli.commands import main
from ray_ckpt.control.phase_machine import Phase
from ray_ckpt.control.replies import PhaseName
from ray_ckpt.control.routes import CONTROL_ROUTES
from ray_ckpt.control.schema import ROUTES, document, reply_schema, request_schema
from ray_ckpt.errors import NotFound
from ray_ckpt.identity import EpisodeId
from tests.unit.helpers import body
from tests.unit.steps.test_receipts_engine import env, finish, wire


def check(route: str, reply: Any) -> None:
    jsonschema.Draft202012Validator(reply_schema(route)).validate(reply)


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def test_every_route_has_a_request_and_a_reply_schema() -> None:
    doc = document()
    jsonschema.Draft202012Validator.check_schema(doc)
    # Every path the routes serve, with its method, and nothing else.
    assert {(e["path"], e["method"]) for e in doc["routes"].values()} == {
        (path, method) for path, (method, _) in CONTROL_ROUTES.items()
    }
    for name in ROUTES:
        # Self-contained: every $ref resolves inside the route's own schema.
        for schema in (reply_schema(name), reply_schema(name, error=True)):
            assert set(refs(schema)) <= {f"#/$defs/{d}" for d in schema["$defs"]}
        request = request_schema(name)
        assert (request is None) == (name == "status")
    assert set(get_args(PhaseName)) == {p.value for p in Phase}
    with pytest.raises(NotFound):
        reply_schema("nope")


def test_requests_follow_the_decoder_and_patterns_are_ecma() -> None:
    valid = jsonschema.Draft202012Validator(request_schema("retire") or {})
    assert valid.is_valid(body("c1", episode_ids=[{"rollout_id": "r1"}]))
    assert not valid.is_valid(body("c1", episode_ids=[]))  # min_length=1
    assert not valid.is_valid(body("c1", episode_ids=[{"rollout_id": "r1"}], extra=1))
    assert "\\Z" not in json.dumps(document())  # ECMA-262 has no \Z


def test_a_reply_with_a_field_the_schema_does_not_name_is_refused() -> None:
    good = {"phase": "idle", "idempotent": True}
    check("resume", good)
    with pytest.raises(jsonschema.ValidationError):
        check("resume", {**good, "surprise": 1})


async def test_replies_outside_the_conformance_suite_match(tmp_path: Path) -> None:
    ctl, p = env()
    try:
        receipt = await finish(p, EpisodeId("r1"), {"reward": 1})
        check("status", ctl.status())
        check("collect", await ctl.handle("collect", {}))
        check("ack", await ctl.handle("ack", {"receipts": wire([receipt]), "check": True}))
        check("ack", await ctl.handle("ack", {"receipts": wire([receipt])}))
        check("prepare", await ctl.handle("prepare", body("c1")))
        check("renew", await ctl.handle("renew", body("c1")))
        commit = body("c1", checkpoint_dir=str(tmp_path / "c1"), durability="async")
        pending = await ctl.handle("commit", commit)
        assert pending["pending"] is True
        check("commit", pending)
        check("status", ctl.status())  # background_write, maybe
        check("resume", await ctl.handle("resume", body("c1")))
        final = await ctl.handle("commit", commit)  # waits for the write
        assert "manifest" in final
        assert "pending" not in final
        check("commit", final)
    finally:
        await ctl.aclose()


def test_the_command_prints_the_document_and_one_route() -> None:
    runner = CliRunner()
    full = runner.invoke(main, ["schema"])
    assert full.exit_code == 0, full.output
    assert json.loads(full.output) == document()
    one = runner.invoke(main, ["schema", "--route", "ack"])
    assert json.loads(one.output)["reply"] == {
        "anyOf": [{"$ref": "#/$defs/AckReply"}, {"$ref": "#/$defs/AckCheckReply"}]
    }
    bad = runner.invoke(main, ["schema", "--route", "nope"])
    assert bad.exit_code == 2
    assert "Traceback" not in bad.output
