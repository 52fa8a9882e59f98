"""Settings from the environment (RAY_CKPT_<FIELD>, pydantic-settings) and from
OmegaConf configs with their interpolations resolved: `${oc.env:TOKEN}` never
reaches a server as a literal."""

from __future__ import annotations

import pathlib

import pytest
from omegaconf import OmegaConf
from pydantic import ValidationError

from ray_ckpt.settings import SettingsError, load_settings, settings_from_dict, settings_from_env

TOKEN = "tok-from-env-5b1e"


def test_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_CKPT_ENABLED", "true")
    monkeypatch.setenv("RAY_CKPT_CONTROL_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("ray_ckpt_lease_grace_seconds", "12.5")  # case-insensitive
    s = load_settings()
    assert s.enabled
    assert s.token == TOKEN
    assert s.lease_grace_seconds == 12.5
    assert TOKEN not in repr(settings_from_env())


def test_the_config_wins_and_the_environment_fills_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_CKPT_CONTROL_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("RAY_CKPT_LEASE_GRACE_SECONDS", "99")
    s = load_settings({"checkpoint": {"enabled": True, "lease_grace_seconds": 5}})
    assert s.token == TOKEN
    assert s.lease_grace_seconds == 5


def test_environment_values_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_CKPT_LEASE_GRACE_SECONDS", "soon")
    with pytest.raises(ValidationError):
        load_settings()
    monkeypatch.setenv("RAY_CKPT_LEASE_GRACE_SECONDS", "-1")  # the model's own bound
    with pytest.raises(ValidationError):
        load_settings()


def test_without_env_the_environment_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_CKPT_ENABLED", "true")
    assert not settings_from_dict({}).enabled


def test_an_omegaconf_config_is_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKEN", TOKEN)
    cfg = OmegaConf.create(
        {
            "grace": 30,
            "checkpoint": {
                "enabled": True,
                "control_auth_token": "${oc.env:TOKEN}",
                "lease_grace_seconds": "${grace}",
            },
            "global_aiohttp_control_connector_limit_per_host": 2,
        }
    )
    s = load_settings(cfg)
    assert s.token == TOKEN
    assert s.lease_grace_seconds == 30
    assert s.global_aiohttp_control_connector_limit_per_host == 2
    # The block alone (cfg.checkpoint is itself a DictConfig) resolves too.
    assert settings_from_dict({"checkpoint": cfg.checkpoint}).token == TOKEN


def test_an_unresolvable_interpolation_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_TOKEN_VAR", raising=False)
    cfg = OmegaConf.create(
        {"checkpoint": {"enabled": True, "control_auth_token": "${oc.env:NO_SUCH_TOKEN_VAR}"}}
    )
    with pytest.raises(SettingsError, match="interpolation"):
        load_settings(cfg)


def test_a_yaml_file_resolves_through_omegaconf(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gym.yaml"
    path.write_text("checkpoint:\n  enabled: true\n  control_auth_token: ${oc.env:TOKEN}\n")
    monkeypatch.setenv("TOKEN", TOKEN)
    assert load_settings(path).token == TOKEN
    monkeypatch.delenv("TOKEN")
    with pytest.raises(SettingsError, match="interpolation"):
        load_settings(path)


def test_a_literal_interpolation_never_becomes_the_token() -> None:
    # A plain mapping (e.g. YAML read without OmegaConf) holding `${...}`.
    block = {"enabled": True, "control_auth_token": "${oc.env:TOKEN}"}
    with pytest.raises(SettingsError, match=r"checkpoint\.control_auth_token"):
        settings_from_dict({"checkpoint": block})
    with pytest.raises(SettingsError):
        settings_from_dict({"checkpoint": {"control_auth_token": "x${y}"}})


def test_a_top_level_that_is_not_a_mapping_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(SettingsError):
        load_settings(path)
    with pytest.raises(SettingsError):
        settings_from_dict(OmegaConf.create([1, 2]))  # type: ignore[arg-type]
