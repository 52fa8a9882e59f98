import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_ckpt import EpisodeId, parse_rollout_path, rollout_path
from ray_ckpt.errors import InvalidRequest

rollout_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,30}\Z").filter(
    lambda s: not re.search(r"-a[1-9][0-9]*$", s)
)


def test_capture_keys() -> None:
    assert EpisodeId("r").capture_key == "r"
    assert EpisodeId("r", 3).capture_key == "r-a3"
    assert EpisodeId.from_capture_key("r-a3") == EpisodeId("r", 3)
    assert EpisodeId.from_capture_key("x-a0") == EpisodeId("x-a0", 0)
    assert EpisodeId("x-a0", 2).capture_key == "x-a0-a2"
    assert EpisodeId.from_capture_key("x-a0-a2") == EpisodeId("x-a0", 2)


@pytest.mark.parametrize("bad", ["", "-r", "r/x", "r a", "r-a1", "r-a12", ".r", "r\n", "r-a1\n"])
def test_bad_rollout_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        EpisodeId(bad)


@pytest.mark.parametrize("bad", ["", "r-a1-a2", "a/b", "-a1", "zz-a1\n", "zz\n", "zz\r"])
def test_malformed_capture_keys_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        EpisodeId.from_capture_key(bad)


def test_negative_or_non_int_attempt_refused() -> None:
    with pytest.raises(InvalidRequest):
        EpisodeId("r", -1)
    with pytest.raises(InvalidRequest):
        EpisodeId("r", True)


@given(rollout_ids, st.integers(min_value=0, max_value=10**6))
def test_capture_key_round_trip(rollout: str, attempt: int) -> None:
    episode = EpisodeId(rollout, attempt)
    assert EpisodeId.from_capture_key(episode.capture_key) == episode


def test_wire_shape_and_decode_validation() -> None:
    assert msgspec.json.encode(EpisodeId("r", 2)) == b'{"rollout_id":"r","attempt":2}'
    assert msgspec.json.decode(b'{"rollout_id":"r"}', type=EpisodeId) == EpisodeId("r", 0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"rollout_id":"r-a1","attempt":0}', type=EpisodeId)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"rollout_id":"r","extra":1}', type=EpisodeId)


def test_rollout_path_prefix_round_trip() -> None:
    path = rollout_path(EpisodeId("r", 2), "/v1/responses")
    assert path == "/ng-rollout/r-a2/v1/responses"
    assert parse_rollout_path(path) == (EpisodeId("r", 2), "/v1/responses")
    assert parse_rollout_path("/v1/responses") == (None, "/v1/responses")
    with pytest.raises(InvalidRequest):
        parse_rollout_path("/ng-rollout/r-a1-a1/verify")
    with pytest.raises(InvalidRequest):
        parse_rollout_path("/ng-rollout//verify")


def test_id_pattern_is_matched_in_full_everywhere() -> None:
    # `$` matches before a final newline: every parser must refuse "abc\n".
    from ray_ckpt.control.wire import decode_request
    from ray_ckpt.errors import InvalidCheckpointState
    from ray_ckpt.identity import RolloutIdStr
    from ray_ckpt.storage.participant.participant_store import check_name

    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'"abc\\n"', type=RolloutIdStr)
    with pytest.raises(InvalidRequest):
        decode_request("prepare", b'{"checkpoint_id": "abc\\n", "deadline_ts": 1.0}')
    with pytest.raises(InvalidRequest):
        parse_rollout_path("/ng-rollout/zz-a1\n/step")
    with pytest.raises(InvalidCheckpointState):
        check_name("kind", "environment\n")
