"""Property-based test of every route on a live participant, over real HTTP.

Both fronts (aiohttp, and ASGI under uvicorn) serve a real engine with the
real file store, in a background event loop; Hypothesis drives them through
`http.client` (raw enough for any method, repeated headers and arbitrary
bodies) with random bodies, methods, headers, IDs, deadlines and directories.

Invariants on every reply: no 5xx; every 4xx carries
`{"error": {"code", "detail"}}`; under the control prefix 401 exactly when the
request does not carry one correct bearer header; an accepted ID always
matches its pattern in full (and no accepted rollout ID ends in the reserved
`-a<N>` suffix); a refused request changes nothing the status shows (phase,
checkpoint ID, lease, retire marks).  After the run each participant
completes a normal checkpoint whose records equal those committed before it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import pathlib
import re
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from ray_ckpt.control.asgi import ControlASGIMiddleware
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX, maybe_install_control_routes
from ray_ckpt.control.wire import OPERATIONS
from ray_ckpt.errors import CheckpointError
from ray_ckpt.gym_server.serving import Serving, bind_socket, serve_app, socket_address
from ray_ckpt.identity import MAX_ID_LENGTH, EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import read_participant
from tests.unit.fakes import FakeParticipant

TOKEN = "fuzz-token"
GOOD_AUTH = f"Bearer {TOKEN}"
ID_FULL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The episode the participant holds through the whole run; generated IDs avoid
# its rollout so an accepted random retire cannot legitimately remove it.
KEEP = "keep"
KEEP_STATE = {"turn": 7, "notes": ["a", "b"]}
# A restart-only episode (never exported): a commit whose scope names it is
# refused by the export, after the fencing, so that refusal is fuzzed too.
RESTART = "rst"
RESERVED = re.compile(r"-a[1-9][0-9]*\Z")
FAR = 2_000_000_000.0


def cp_settings() -> CheckpointSettings:
    return CheckpointSettings(
        enabled=True,
        control_auth_token=SecretStr(TOKEN),
        max_control_body_bytes=64 * 1024,
        lease_grace_seconds=3600,
    )


@dataclass
class Front:
    name: str
    host: str
    port: int
    ctl: ParticipantEngine
    participant: FakeParticipant
    seen: dict[int, int] = field(default_factory=dict)


def _echo(key: str) -> dict[str, Any]:
    episode = EpisodeId.from_capture_key(key)
    return {"key": key, "rollout": episode.rollout_id, "attempt": episode.attempt}


def _aiohttp_app(ctl: ParticipantEngine) -> web.Application:
    app = web.Application()

    async def echo(request: web.Request) -> web.Response:
        try:
            return web.json_response(_echo(request.match_info["key"]))
        except CheckpointError as exc:
            return web.json_response(exc.to_body(), status=exc.http_status)

    app.router.add_post("/ng-rollout/{key}/echo", echo)
    assert maybe_install_control_routes(app, ctl, cp_settings())
    return app


def _asgi_app(ctl: ParticipantEngine) -> Any:
    api = FastAPI()

    @api.post("/ng-rollout/{key}/echo")
    async def echo(key: str) -> dict[str, Any]:
        return _echo(key)

    return ControlASGIMiddleware.from_settings(api, ctl, cp_settings())


class Loop:
    """An event loop in a thread: the servers live there, the test calls in."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        fut: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def fronts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Front]]:
    loop = Loop()
    servings: list[Serving] = []
    built: list[Front] = []

    async def start(name: str) -> Front:
        participant = FakeParticipant()
        participant.start(KEEP, at_boundary=True, state=KEEP_STATE)
        participant.start(RESTART, state={"lost": True})
        participant.restarts.add(RESTART)
        ctl = ParticipantEngine(participant, instance="env-0", settings=cp_settings())
        app = _aiohttp_app(ctl) if name == "aiohttp" else _asgi_app(ctl)
        sock = bind_socket("127.0.0.1", 0)
        host, port = socket_address(sock)
        servings.append(await serve_app(app, sock, drain_s=1.0))
        return Front(name, host, port, ctl, participant)

    try:
        for name in ("aiohttp", "asgi"):
            built.append(loop.run(start(name)))
        yield built
    finally:
        for s in servings:
            loop.run(s.stop())
        for f in built:
            loop.run(f.ctl.aclose())
        loop.close()


def request(
    front: Front, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None
) -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection(front.host, front.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def call_json(front: Front, op: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, raw, _ = request(
        front,
        "POST",
        f"{CHECKPOINT_ROUTE_PREFIX}/{op}",
        [("Authorization", GOOD_AUTH)],
        orjson.dumps(body),
    )
    return status, orjson.loads(raw)


def checkpoint(front: Front, cid: str, directory: pathlib.Path) -> list[tuple[str, Any]]:
    """A normal checkpoint: prepare, commit, resume; returns the committed records."""
    base = {"checkpoint_id": cid, "deadline_ts": FAR}
    status, reply = call_json(front, "prepare", base)
    assert (status, reply["phase"]) == (200, "prepared"), reply
    commit = {**base, "checkpoint_dir": str(directory)}
    status, reply = call_json(front, "commit", commit)
    assert status == 200, reply
    status, reply = call_json(front, "resume", base)
    assert (status, reply["phase"]) == (200, "idle"), reply
    _, records = read_participant(
        directory, kind="environment", instance="env-0", checkpoint_id=cid
    )
    return [(r.key, r.state) for r in records]


# --- strategies -----------------------------------------------------------------------

good_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,20}\Z").filter(
    lambda s: all(s != k and not s.startswith(f"{k}-a") for k in (KEEP, RESTART))
)
ids = st.one_of(
    good_ids,
    good_ids.map(lambda s: s + "\n"),
    good_ids.map(lambda s: s + "\r\n"),
    good_ids.map(lambda s: "-" + s),
    st.just("x" * (MAX_ID_LENGTH + 1)),
    st.just(""),
    st.text(max_size=12),
    st.sampled_from(["r-a1", "ok\x00", "a/b", "a b", "ü"]),
)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8)
)
deadlines = st.one_of(
    st.just(FAR),
    st.floats(min_value=0, max_value=3e9),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    json_scalars,
)
episodes = st.one_of(
    st.fixed_dictionaries({"rollout_id": ids}, optional={"attempt": st.integers(-2, 5)}),
    st.dictionaries(st.text(max_size=8), json_scalars, max_size=3),
    json_scalars,
)


def directories(tmp: str) -> st.SearchStrategy[Any]:
    long = "y" * 300
    return st.one_of(
        st.sampled_from(
            [
                "/dev/null/x",
                "/proc/self/x",
                "/proc/1/fdinfo",
                "/sys/x",
                f"{tmp}/a\x00b",
                f"{tmp}/{long}",
                f"{tmp}/regular-file/x",
                "",
                "relative/dir",
            ]
        ),
        st.integers(0, 5).map(lambda i: f"{tmp}/fz{i}"),
        json_scalars,
    )


def bodies(tmp: str) -> st.SearchStrategy[bytes | None]:
    fields = {
        "checkpoint_id": ids,
        "deadline_ts": deadlines,
        "checkpoint_dir": directories(tmp),
        "episode_ids": st.one_of(st.lists(episodes, max_size=3), json_scalars),
        "rollout_ids": st.one_of(st.lists(ids, max_size=3), json_scalars),
        "stop": json_scalars,
        "extra": json_scalars,
    }
    # The stdlib encoder: it takes integers beyond 64 bits and NaN (as `NaN`).
    objects = st.fixed_dictionaries({}, optional=fields).map(lambda d: json.dumps(d).encode())
    return st.one_of(
        objects,
        objects,
        st.binary(max_size=64),
        st.sampled_from([b"", b"[]", b"null", b"{", b'"x"', b"{}" * 3]),
        st.none(),
    )


auths = st.one_of(
    st.just([GOOD_AUTH]),
    st.just([GOOD_AUTH]),
    st.just([]),
    st.just([GOOD_AUTH, GOOD_AUTH]),
    st.permutations([GOOD_AUTH, "Bearer nope"]),
    st.sampled_from(
        [
            [f"bearer {TOKEN}"],
            [TOKEN],
            [f"Bearer  {TOKEN}"],
            [f"Bearer {TOKEN} "],
            [f"Bearer {TOKEN}x"],
            ["Basic Zm9vOmJhcg=="],
        ]
    ).map(list),
    st.lists(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126)), max_size=2),
)
methods = st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])


def paths() -> st.SearchStrategy[tuple[str, str]]:
    control = st.sampled_from(["status", *OPERATIONS]).map(lambda op: ("control", op))
    odd = st.sampled_from(["", "explode", "status/", "prepare/x", "commit%0A"]).map(
        lambda op: ("control", op)
    )
    data = ids.map(lambda key: ("data", key))
    return st.one_of(control, control, control, odd, data)


def well_formed(op: str, tmp: str) -> st.SearchStrategy[bytes]:
    """A body the engine decodes (so the call reaches its phase rules)."""
    cids = st.one_of(st.sampled_from(["c1", "c2", "c3"]), good_ids)
    # Several future deadlines, so a lease a refused call moved shows.
    deadline = st.sampled_from([FAR, FAR, FAR - 1000, FAR + 1000, 1.0, 0.0])
    eps = st.lists(
        st.one_of(
            st.fixed_dictionaries({"rollout_id": good_ids, "attempt": st.integers(0, 3)}),
            st.just({"rollout_id": RESTART, "attempt": 0}),
        ),
        min_size=1,
        max_size=2,
    )
    fields: dict[str, st.SearchStrategy[Any]] = {"checkpoint_id": cids, "deadline_ts": deadline}
    if op in ("commit", "restore"):
        fields["checkpoint_dir"] = directories(tmp).filter(lambda d: isinstance(d, str) and d)
        fields["episode_ids"] = eps
    if op in ("retire",):
        fields["episode_ids"] = eps
    if op == "forget":
        fields["rollout_ids"] = st.lists(
            st.one_of(good_ids, st.sampled_from(["r-a1", "x.y-a20"])), min_size=1, max_size=2
        )
    return st.fixed_dictionaries(fields).map(lambda d: json.dumps(d).encode())


@st.composite
def requests(draw: st.DrawFn, tmp: str) -> tuple[str, tuple[str, str], list[str], bytes | None]:
    where = draw(paths())
    plane, name = where
    right = "GET" if (plane, name) == ("control", "status") else "POST"
    # Mostly the right method and token, so most calls reach the engine.
    method = right if draw(st.integers(0, 9)) < 7 else draw(methods)
    auth = [GOOD_AUTH] if draw(st.integers(0, 9)) < 6 else draw(auths)
    if plane == "control" and name in OPERATIONS and draw(st.booleans()):
        body: bytes | None = draw(well_formed(name, tmp))
    else:
        body = draw(bodies(tmp))
    return method, where, auth, body


# --- the property ---------------------------------------------------------------------


def check_reply(
    front: Front,
    method: str,
    where: tuple[str, str],
    auth: list[str],
    body: bytes | None,
) -> None:
    plane, name = where
    if plane == "control":
        path = f"{CHECKPOINT_ROUTE_PREFIX}/{name}"
    else:
        path = f"/ng-rollout/{urllib.parse.quote(name, safe='')}/echo"
    before = observed(front)
    status, raw, _ = request(front, method, path, [("Authorization", a) for a in auth], body)
    front.seen[status] = front.seen.get(status, 0) + 1
    assert status < 500, (front.name, method, path, raw)
    reply: Any = orjson.loads(raw) if raw else None
    if status >= 400:
        assert isinstance(reply, dict), (front.name, status, raw)
        assert set(reply) == {"error"}, reply
        err = reply["error"]
        assert isinstance(err.get("code"), str), reply
        assert isinstance(err.get("detail"), str), reply
        if not write_attempted(front, where, body, err["code"]):
            # Refused: nothing changed, the lease included.
            assert observed(front) == before, (front.name, method, path, body, reply)
    if plane == "control":
        # Leading and trailing whitespace is not part of a field value (RFC 9110
        # §5.5): both parsers drop it before the token is compared.
        one_good = [a.strip(" \t") for a in auth] == [GOOD_AUTH]
        assert (status == 401) == (not one_good), (front.name, method, path, auth, status)
    if status == 200 and plane == "data":
        # A key the route accepted matches the ID pattern in full.
        assert ID_FULL.fullmatch(reply["key"]), reply
        assert reply["key"] == name
    if status == 200 and plane == "control" and name != "status" and body is not None:
        sent = json.loads(body)
        cid = sent["checkpoint_id"]
        assert ID_FULL.fullmatch(cid), sent
        assert len(cid) <= MAX_ID_LENGTH
        for ep in sent.get("episode_ids") or []:
            assert ID_FULL.fullmatch(ep["rollout_id"]), sent
            assert not RESERVED.search(ep["rollout_id"]), sent
        for rid in sent.get("rollout_ids") or []:
            assert ID_FULL.fullmatch(rid), sent
            assert not RESERVED.search(rid), sent


def observed(front: Front) -> tuple[Any, ...]:
    """What a refused request must leave as it was.  Read from this thread
    between requests: each call has ended before its reply came back."""
    st = front.ctl.status()
    return st["phase"], st["checkpoint_id"], st["lease_expires_at"], st["retired_rollouts"]


def write_attempted(front: Front, where: tuple[str, str], body: bytes | None, code: str) -> bool:
    """A commit accepted, whose store write then failed (a directory the store
    refuses, or one holding another commit): not a refusal.  Its write stays
    registered for a retry, which is how it is told apart."""
    if where != ("control", "commit") or body is None or code == "checkpoint_conflict":
        return False
    try:
        cid = json.loads(body)["checkpoint_id"]
    except (ValueError, TypeError, KeyError):
        return False
    return isinstance(cid, str) and cid in front.ctl._writes


def test_every_route_under_random_requests(
    fronts: list[Front], tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "regular-file").write_text("not a directory")
    before = {f.name: checkpoint(f, "before", tmp / f"before-{f.name}") for f in fronts}
    for recs in before.values():
        assert recs == [(KEEP, KEEP_STATE)]

    @settings(
        max_examples=400,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(front=st.sampled_from(fronts), req=requests(str(tmp)))
    def fuzz(front: Front, req: tuple[str, tuple[str, str], list[str], bytes | None]) -> None:
        method, where, auth, body = req
        check_reply(front, method, where, auth, body)

    fuzz()
    for f in fronts:
        # Close whatever an accepted random call left open, then checkpoint again.
        status = f.ctl.status()
        if status.get("checkpoint_id") is not None and status["phase"] != "idle":
            code, reply = call_json(
                f, "resume", {"checkpoint_id": status["checkpoint_id"], "deadline_ts": FAR}
            )
            assert code == 200, reply
        after = checkpoint(f, "after", tmp / f"after-{f.name}")
        assert after == before[f.name], f.name
        # The run reached the engine, not just the gate.
        assert set(f.seen) & {200, 400, 409}, f.seen


def test_every_refused_call_leaves_the_status_as_it_was(
    fronts: list[Front], tmp_path: pathlib.Path
) -> None:
    """Each operation refused over HTTP, on an open checkpoint whose lease a
    later deadline would move: the reply is a typed 4xx and nothing the
    status shows changes (the random run above reaches these rarely)."""
    later = FAR + 1000
    ck = str(tmp_path / "ck")
    scope = [{"rollout_id": KEEP}, {"rollout_id": RESTART}]
    refused: list[tuple[str, dict[str, Any], int, str]] = [
        ("prepare", {"checkpoint_id": "other", "deadline_ts": later}, 409, "checkpoint_conflict"),
        ("renew", {"checkpoint_id": "other", "deadline_ts": later}, 409, "checkpoint_conflict"),
        ("renew", {"checkpoint_id": "refusals-open", "deadline_ts": 1.0}, 409, "deadline_exceeded"),
        (
            "renew",
            {"checkpoint_id": "refusals-open", "deadline_ts": later, "x": 1},
            400,
            "invalid_request",
        ),
        (
            "commit",
            {
                "checkpoint_id": "refusals-open",
                "deadline_ts": later,
                "checkpoint_dir": ck,
                "episode_ids": scope,
            },
            409,
            "restart_in_scope",
        ),
        (
            "commit",
            {"checkpoint_id": "refusals-open", "deadline_ts": 1.0, "checkpoint_dir": ck},
            409,
            "deadline_exceeded",
        ),
        (
            "commit",
            {"checkpoint_id": "refusals-open", "deadline_ts": later},
            400,
            "invalid_request",
        ),
        (
            "restore",
            {
                "checkpoint_id": "refusals-open",
                "deadline_ts": later,
                "checkpoint_dir": ck,
                "episode_ids": [{"rollout_id": KEEP}],
            },
            409,
            "invalid_phase",
        ),
        (
            "retire",
            {
                "checkpoint_id": "refusals-open",
                "deadline_ts": later,
                "episode_ids": [{"rollout_id": "z"}],
            },
            409,
            "invalid_phase",
        ),
        (
            "forget",
            {"checkpoint_id": "refusals-open", "deadline_ts": later, "rollout_ids": ["z-a1"]},
            400,
            "invalid_request",
        ),
        ("resume", {"checkpoint_id": "other", "deadline_ts": later}, 409, "checkpoint_conflict"),
        (
            "resume",
            {"checkpoint_id": "refusals-open", "deadline_ts": later, "abort": 1},
            400,
            "invalid_request",
        ),
    ]
    for f in fronts:
        code, reply = call_json(
            f, "prepare", {"checkpoint_id": "refusals-open", "deadline_ts": FAR - 1000}
        )
        assert (code, reply["phase"]) == (200, "prepared"), reply
        before = observed(f)
        for op, sent, status, reason in refused:
            code, reply = call_json(f, op, sent)
            assert (code, reply["error"]["code"]) == (status, reason), (f.name, op, sent, reply)
            assert observed(f) == before, (f.name, op, sent)
        code, reply = call_json(f, "resume", {"checkpoint_id": "refusals-open", "deadline_ts": FAR})
        assert code == 200, reply
