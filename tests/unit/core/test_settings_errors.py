import pickle

import pytest
from pydantic import ValidationError

from ray_ckpt.errors import (
    CoordinationFailed,
    Reason,
    StaleCheckpoint,
    error_from_body,
)
from ray_ckpt.settings import CheckpointSettings, load_settings, settings_from_dict


def test_off_by_default() -> None:
    s = CheckpointSettings()
    assert not s.enabled
    assert s.lease_grace_seconds == 600


def test_token_required_when_enabled() -> None:
    with pytest.raises(ValidationError):
        CheckpointSettings(enabled=True)
    with pytest.raises(ValidationError):
        settings_from_dict({"checkpoint": {"enabled": True, "control_auth_token": ""}})


def test_token_never_printed() -> None:
    s = CheckpointSettings(enabled=True, control_auth_token="s3cret-token")
    assert "s3cret-token" not in repr(s)
    assert "s3cret-token" not in str(s.model_dump())
    assert "s3cret-token" not in s.model_dump_json()
    assert s.token == "s3cret-token"


def test_lease_must_be_positive_and_unknown_keys_refused() -> None:
    with pytest.raises(ValidationError):
        CheckpointSettings(lease_grace_seconds=0)
    with pytest.raises(ValidationError):
        settings_from_dict({"checkpoint": {"enabeld": True}})


def test_yaml_and_top_level_pool_limits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "checkpoint:\n  enabled: true\n  control_auth_token: tok\n  lease_grace_seconds: 5\n"
        "global_aiohttp_control_connector_limit_per_host: 3\n"
    )
    s = load_settings(path)
    assert s.enabled and s.lease_grace_seconds == 5
    assert s.global_aiohttp_control_connector_limit_per_host == 3


def test_reasons_have_codes_statuses_and_retryable() -> None:
    assert Reason.STALE_CHECKPOINT.http_status == 409
    assert Reason.UNAUTHORIZED.http_status == 401
    assert Reason.INVALID_CHECKPOINT_STATE.http_status == 422
    assert Reason.DEADLINE_EXCEEDED.retryable
    assert not Reason.STALE_CHECKPOINT.retryable
    assert all(isinstance(r.http_status, int) for r in Reason)


def test_errors_survive_pickling_and_the_wire() -> None:
    err = pickle.loads(pickle.dumps(StaleCheckpoint("old")))
    assert isinstance(err, StaleCheckpoint) and err.detail == "old"
    again = error_from_body(409, err.to_body())
    assert isinstance(again, StaleCheckpoint)
    cf = pickle.loads(
        pickle.dumps(CoordinationFailed("x", operation="prepare", failures={"a": {}}))
    )
    assert cf.operation == "prepare" and cf.failures == {"a": {}}
    assert error_from_body(500, "boom").code == "invalid_request"


def test_method_not_allowed_is_a_typed_405() -> None:
    from ray_ckpt.errors import MethodNotAllowed

    assert Reason.METHOD_NOT_ALLOWED.http_status == 405
    assert not Reason.METHOD_NOT_ALLOWED.retryable
    body = {"error": {"code": "method_not_allowed", "detail": "GET is not allowed"}}
    err = error_from_body(405, body)
    assert isinstance(err, MethodNotAllowed)
    assert err.detail == "GET is not allowed"


def test_every_typed_error_comes_back_as_itself_from_the_wire() -> None:
    """Each error class of ours, sent as its wire body, is rebuilt as that
    class (a class missing from the code table came back as the root)."""
    import ray_ckpt.errors as errors

    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type)
        and issubclass(c, errors.CheckpointError)
        and c is not errors.CheckpointError
        and "reason" in vars(c)
    ]
    assert len(classes) >= 15
    for cls in classes:
        err = cls("detail")
        again = error_from_body(err.reason.http_status, err.to_body())
        assert type(again) is cls, cls.__name__
