"""The NeMo Gym wrapper in the main venv: a NeMo-shaped FastAPI server on a real
loopback uvicorn, behind the wrapper and the control front, with a real
engine writing real files.  Prefix stripping, sessions keyed by capture
key (never by a parsed UUID), admission, in-flight counting, stale attempts,
session ends, restart-only headers, export/restore and typed export errors."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr

from participants.nemo_gym import NemoGymServer, session_fields, wrap
from ray_ckpt.control.asgi import ControlASGIMiddleware
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.gym_server.serving import Serving, bind_socket, serve_app, socket_address
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from tests.nemo_gym.nemo_like import CounterServer, wait_entered

TOKEN = "nemo-wrapper-token"
SETTINGS = CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN))


def body(cid: str, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + 10, **extra}


class Hosted:
    def __init__(self, gym: NemoGymServer, ctl: ParticipantEngine, url: str) -> None:
        self.gym = gym
        self.ctl = ctl
        self.url = url
        self.server: CounterServer = gym.server

    def at(self, key: str, route: str) -> str:
        return f"{self.url}/ng-rollout/{key}/{route}"


Start = Callable[..., Any]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    running: list[tuple[Serving, ParticipantEngine]] = []

    async def go(**options: Any) -> Hosted:
        gym = wrap(CounterServer(), **options)
        ctl = ParticipantEngine(gym.participant, instance="counter", settings=SETTINGS)
        gym.attach(ctl)
        app = ControlASGIMiddleware.from_settings(gym.app(), ctl, SETTINGS)
        sock = bind_socket("127.0.0.1", 0)
        serving = await serve_app(app, sock, drain_s=0.5)
        ctl.start()
        running.append((serving, ctl))
        host, port = socket_address(sock)
        return Hosted(gym, ctl, f"http://{host}:{port}")

    yield go
    for serving, ctl in running:
        await serving.stop()
        await ctl.aclose()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # A cookie jar like a browser's: the test shows the capture key wins over it.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, data: Any = None) -> tuple[int, Any, Any]:
    async with http.post(url, json=data if data is not None else {}) as resp:
        return resp.status, await resp.json(), resp.headers


async def test_prefix_is_stripped_and_the_session_is_the_capture_key(
    start: Start, http: aiohttp.ClientSession
) -> None:
    h = await start(exported=True)
    status, _, headers = await post(http, h.at("r", "seed_session"), {"initial_count": 3})
    assert status == 200
    assert headers["x-ng-checkpoint-verify"] == "wait"
    assert "x-ng-checkpoint-restart" not in headers
    await post(http, h.at("r-a2", "seed_session"), {"initial_count": 7})
    # The same client (same cookie jar) for both: the key decides, not the cookie.
    assert h.server.session_id_to_counter == {"r": 3, "r-a2": 7}
    assert (await post(http, h.at("r", "increment_counter"), {"count": 2}))[0] == 200
    assert h.server.session_id_to_counter["r"] == 5
    async with http.get(h.at("r-a2", "whoami")) as resp:
        assert (await resp.json())["session_id"] == "r-a2"
    # Outside the prefix the server keeps its own cookie sessions (a UUID).
    async with http.get(f"{h.url}/whoami") as resp:
        own = (await resp.json())["session_id"]
    assert own not in ("r", "r-a2")
    assert len(own) == 36
    async with http.get(f"{h.url}/") as resp:  # NeMo Gym's liveness route
        assert await resp.json() == {"status": "ok"}


async def test_a_uuid_session_is_never_read_as_a_capture_key(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    h = await start(exported=True)
    await post(http, h.at("r", "seed_session"), {"initial_count": 1})
    # A cookie session whose UUID ends in -a<digits>: as a key it would be
    # rollout "12345678-1234-4234-9234", attempt 12345678901.
    uuid_like = "12345678-1234-4234-9234-a12345678901"
    h.server.session_id_to_counter[uuid_like] = 99
    await post(http, f"{h.url}/increment_counter", {"count": 4})  # a fresh UUID session too
    status = h.ctl.status()
    assert status["live_executions"] == 0
    assert (await h.ctl.handle("prepare", body("c1")))["phase"] == "prepared"
    report = await h.ctl.handle("prepare", body("c1"))
    assert report["report"]["counts"]["sessions"] == 1
    await h.ctl.handle("commit", body("c1", checkpoint_dir=str(tmp_path / "ck")))
    await h.ctl.handle("resume", body("c1"))
    # Only the session the front bound was exported; the UUID ones stayed put.
    fresh = await start(exported=True)
    reply = await fresh.ctl.handle(
        "restore",
        body("c2", checkpoint_dir=str(tmp_path / "ck"), episode_ids=[{"rollout_id": "r"}]),
    )
    assert reply["restored"] == ["r-a1"]
    assert fresh.server.session_id_to_counter == {"r-a1": 1}


async def test_admission_waits_out_a_checkpoint_and_counts_in_flight(
    start: Start, http: aiohttp.ClientSession
) -> None:
    h = await start(exported=True)
    await post(http, h.at("r", "seed_session"))
    h.server.hold = asyncio.Event()
    slow = asyncio.create_task(post(http, h.at("r", "increment_counter"), {"count": 1}))
    await wait_entered(h.server, 1)
    assert h.gym.participant.live_executions() == 1
    # An exported server's in-flight call blocks prepare (its state is mid-change).
    reply = await h.ctl.handle("prepare", {**body("c1"), "deadline_ts": time.time() + 0.3})
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == ["r"]
    h.server.hold.set()
    assert (await slow)[0] == 200
    assert (await h.ctl.handle("prepare", body("c1")))["phase"] == "prepared"
    # Admission is closed: a new call waits (never refused) until resume.
    h.server.hold = None
    late = asyncio.create_task(post(http, h.at("r", "increment_counter"), {"count": 10}))
    await asyncio.sleep(0.3)
    assert not late.done()
    assert h.server.session_id_to_counter["r"] == 1
    await h.ctl.handle("resume", body("c1"))
    assert (await late)[0] == 200
    assert h.server.session_id_to_counter["r"] == 11
    assert h.gym.participant.live_executions() == 0


async def test_retired_and_superseded_attempts_are_refused_stale(
    start: Start, http: aiohttp.ClientSession
) -> None:
    h = await start(exported=True)
    await post(http, h.at("r", "seed_session"), {"initial_count": 2})
    retired = await h.ctl.handle("retire", body("x", episode_ids=[{"rollout_id": "r"}]))
    assert retired["retired"] == ["r"]
    assert h.server.session_id_to_counter == {}  # retire frees the session
    status, err, _ = await post(http, h.at("r", "increment_counter"), {"count": 1})
    assert status == 409
    assert err["error"]["code"] == "stale_attempt"
    assert h.server.session_id_to_counter == {}  # refused: nothing changed
    # Closing is never refused, not even for the retired attempt.
    assert (await post(http, h.at("r", "close_session")))[:2] == (200, {"closed": False})
    # The next attempt is served; a malformed key never reaches the server.
    assert (await post(http, h.at("r-a1", "seed_session")))[0] == 200
    status, err, _ = await post(http, h.at("_x", "seed_session"))
    assert status == 400
    assert err["error"]["code"] == "invalid_request"


async def test_sessions_end_on_verify_terminal_step_and_close(
    start: Start, http: aiohttp.ClientSession
) -> None:
    h = await start(exported=True)
    for key in ("v", "s", "c"):
        await post(http, h.at(key, "seed_session"))
    assert len(h.gym.participant.sessions) == 3
    _, reward, _ = await post(http, h.at("v", "verify"))
    assert reward == {"reward": 0.0}
    await post(http, h.at("s", "step"), {"action": 4})
    assert h.gym.participant.sessions == {EpisodeId("s"), EpisodeId("c")}
    _, reply, _ = await post(http, h.at("s", "step"), {"action": 6})
    assert reply["terminated"] is True
    # Over: no longer live (never exported, never a restart), but the state is
    # the server's until the caller closes or retires it.
    assert h.gym.participant.sessions == {EpisodeId("c")}
    assert h.gym.participant.finished == {EpisodeId("v"), EpisodeId("s")}
    assert h.server.session_id_to_counter == {"v": 0, "s": 10, "c": 0}
    # A verify of an episode never seeded here (a stateless verifier's) tracks nothing.
    assert (await post(http, h.at("z", "verify")))[:2] == (200, {"reward": 0.0})
    assert h.gym.participant.finished == {EpisodeId("v"), EpisodeId("s")}
    report = await h.ctl.handle("prepare", body("c1"))
    assert report["report"]["counts"]["sessions"] == 1
    assert report["report"]["counts"]["finished"] == 2
    await h.ctl.handle("resume", body("c1"))
    # The server has no /close_session: the front answers it (never refused).
    status, closed, _ = await post(http, h.at("c", "close_session"))
    assert (status, closed) == (200, {"closed": True})
    assert (await post(http, h.at("v", "close_session")))[:2] == (200, {"closed": True})
    retired = await h.ctl.handle("retire", body("x", episode_ids=[{"rollout_id": "s"}]))
    assert retired["retired"] == ["s"]
    assert h.gym.participant.sessions == set()
    assert h.gym.participant.finished == set()
    assert h.server.session_id_to_counter == {}
    assert h.server.session_id_to_rng == {}


async def test_replies_past_the_end_of_an_episode_are_the_unwrapped_servers(
    start: Start, http: aiohttp.ClientSession
) -> None:
    """The wrapper never changes a server's own replies: a `/step` after the
    terminal one, and a call after `/verify`, answer as the bare server does."""
    h = await start(exported=True)
    bare = CounterServer()
    sock = bind_socket("127.0.0.1", 0)
    serving = await serve_app(bare.setup_webserver(), sock, drain_s=0.5)
    host, port = socket_address(sock)
    calls: list[tuple[str, dict[str, Any]]] = [
        ("seed_session", {"initial_count": 1, "seed": 5}),
        ("step", {"action": 4}),
        ("step", {"action": 6}),  # terminal
        ("step", {"action": 1}),  # past the end
        ("get_counter_value", {}),
        ("verify", {}),
        ("get_counter_value", {}),
    ]
    try:
        # Its own cookie jar: the bare server keys the episode by its cookie session.
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as own:
            for route, data in calls:
                wrapped = (await post(http, h.at("r", route), data))[:2]
                unwrapped = (await post(own, f"http://{host}:{port}/{route}", data))[:2]
                assert wrapped == unwrapped, route
    finally:
        await serving.stop()
    assert h.gym.participant.sessions == set()
    assert h.gym.participant.finished == {EpisodeId("r")}


async def test_restart_only_by_default_says_so_and_exports_nothing(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    h = await start()
    _, _, headers = await post(http, h.at("r", "seed_session"))
    assert headers["x-ng-checkpoint-restart"] == "1"
    h.server.hold = asyncio.Event()
    slow = asyncio.create_task(post(http, h.at("r", "increment_counter"), {"count": 1}))
    await wait_entered(h.server, 1)
    # Restart-only never blocks: prepared at once, the session listed as a restart.
    reply = await h.ctl.handle("prepare", body("c1"))
    assert reply["phase"] == "prepared"
    assert reply["report"]["restarts"] == ["r"]
    committed = await h.ctl.handle("commit", body("c1", checkpoint_dir=str(tmp_path / "ck")))
    assert committed["episode_ids"] == []
    await h.ctl.handle("resume", body("c1"))
    h.server.hold.set()
    assert (await slow)[0] == 200


async def test_exported_state_continues_after_restore(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    h = await start(exported=["session_id_to_counter", "session_id_to_rng"])
    await post(http, h.at("r", "seed_session"), {"initial_count": 5, "seed": 11})
    await post(http, h.at("r", "get_counter_value"))  # a draw before the checkpoint
    await h.ctl.handle("prepare", body("c1"))
    await h.ctl.handle("commit", body("c1", checkpoint_dir=str(tmp_path / "ck")))
    await h.ctl.handle("resume", body("c1"))
    expected = [(await post(http, h.at("r", "get_counter_value")))[1] for _ in range(3)]

    fresh = await start(exported=["session_id_to_counter", "session_id_to_rng"])
    await fresh.ctl.handle(
        "restore",
        body("c2", checkpoint_dir=str(tmp_path / "ck"), episode_ids=[{"rollout_id": "r"}]),
    )
    await fresh.ctl.handle("resume", body("c2"))
    again = [(await post(http, fresh.at("r-a1", "get_counter_value")))[1] for _ in range(3)]
    assert again == expected  # the generator continues where the checkpoint cut it
    # The restored attempt supersedes the checkpointed one there.
    status, err, _ = await post(http, fresh.at("r", "get_counter_value"))
    assert (status, err["error"]["code"]) == (409, "stale_attempt")


async def test_an_unknown_type_fails_the_commit_typed_with_its_path(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    h = await start(exported=True)
    assert session_fields(h.server) == ["session_id_to_counter", "session_id_to_rng"]
    await post(http, h.at("r", "seed_session"))
    h.server.session_id_to_rng["r"] = random.SystemRandom()
    await h.ctl.handle("prepare", body("c1"))
    with pytest.raises(InvalidCheckpointState) as caught:
        await h.ctl.handle("commit", body("c1", checkpoint_dir=str(tmp_path / "ck")))
    assert "episode r: state.session_id_to_rng is random.SystemRandom: register a codec" in str(
        caught.value
    )
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").rglob("manifest.json"))
    await h.ctl.handle("resume", body("c1"))


async def test_sidecar_mode_serves_the_control_routes_in_the_servers_process(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    from ray_ckpt.control.client import ControlClient

    gym = wrap(CounterServer(), exported=True)
    app = gym.sidecar_app(SETTINGS, instance="counter-sidecar")
    sock = bind_socket("127.0.0.1", 0)
    serving = await serve_app(app, sock, drain_s=0.5)
    host, port = socket_address(sock)
    url = f"http://{host}:{port}"
    try:
        await post(http, f"{url}/ng-rollout/r/seed_session", {"initial_count": 4})
        async with ControlClient.from_settings(url, SETTINGS) as client:
            assert (await client.status())["instance"] == "counter-sidecar"
            await client.call("prepare", body("s1"))
            reply = await client.call("commit", body("s1", checkpoint_dir=str(tmp_path / "ck")))
            assert reply["episode_ids"] == ["r"]
            await client.call("resume", body("s1"))
            await client.call("retire", body("s2", episode_ids=[{"rollout_id": "r"}]))
        # The front got the sidecar's engine: the retired attempt is refused.
        status, err, _ = await post(http, f"{url}/ng-rollout/r/get_counter_value")
        assert (status, err["error"]["code"]) == (409, "stale_attempt")
    finally:
        await serving.stop()
        assert gym.front is not None
        assert gym.front.engine is not None
        await gym.front.engine.aclose()


async def test_a_bad_record_installs_nothing() -> None:
    from participants.nemo_gym import Codecs, SessionStates
    from ray_ckpt.identity import EpisodeId

    server = CounterServer()
    states = SessionStates(server, ["session_id_to_counter"], Codecs())
    good = states.encode_session("r")  # no state yet: an empty record
    assert good == {}
    server.session_id_to_counter["r"] = 3
    good = states.encode_session("r")
    bad_field = {"not_a_field": 1}
    bad_data = {"session_id_to_counter": {"$codec": "nope", "data": 1}}
    for bad in (bad_field, bad_data, ["not", "a", "dict"]):
        with pytest.raises(InvalidCheckpointState):
            await states.restore_session_states({EpisodeId("a", 1): good, EpisodeId("b", 1): bad})
        assert server.session_id_to_counter == {"r": 3}  # nothing installed
    await states.restore_session_states({EpisodeId("a", 1): good})
    assert server.session_id_to_counter == {"r": 3, "a-a1": 3}
    with pytest.raises(ValueError, match="not a dict of sessions"):
        SessionStates(server, ["hold"], Codecs())
