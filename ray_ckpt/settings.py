"""The `checkpoint:` settings block (pydantic: settings are an edge).

Checkpointing is off by default; with it off, no server installs any
checkpoint route or behaviour.  The control token is required when it is on
and never appears in reprs, logs or dumps (`SecretStr`).

Where settings come from (`load_settings`): a YAML file, a dict, or an
OmegaConf config (NeMo Gym and NeMo RL configure through Hydra/OmegaConf), and
the environment: `RAY_CKPT_<FIELD>` (e.g. `RAY_CKPT_ENABLED=true`,
`RAY_CKPT_CONTROL_AUTH_TOKEN=...`), read by pydantic-settings.  A value the
config gives wins; the environment fills in what it leaves out.  OmegaConf
interpolations (`${oc.env:TOKEN}`) are resolved before we read a value, and a
value that still looks like one (`${...}`, e.g. a plain YAML file read without
OmegaConf) is refused with `SettingsError`: it must never reach a server as a
literal token.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, create_model, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "RAY_CKPT_"
"""Environment variables `RAY_CKPT_<FIELD>` (case-insensitive) set any field."""


class SettingsError(ValueError):
    """A settings source that cannot be read as given (never shows a value)."""


class CheckpointSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    control_auth_token: SecretStr | None = None
    lease_grace_seconds: float = Field(default=600.0, gt=0)
    # The reserved control pool: separate from the data pool so data calls
    # holding every connection cannot starve prepare, commit or resume.
    global_aiohttp_control_connector_limit: int = Field(default=64, gt=0)
    global_aiohttp_control_connector_limit_per_host: int = Field(default=8, gt=0)
    # Largest control request body accepted, in bytes (a commit scope can be long).
    max_control_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    # Incremental checkpoints (`ray_ckpt.storage.participant.incremental`): a full rewrite
    # every this many checkpoints, or when the referenced bytes are below this
    # fraction of the earlier files they point into.  1 turns references off.
    incremental_full_every: int = Field(default=8, ge=1)
    incremental_min_live_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    # Completion receipts (`ray_ckpt.steps.receipts`): an environment server
    # keeps each finished result until the trainer acknowledges it, and a
    # checkpoint carries the unacknowledged ones.  Off: results are released
    # on delivery, as before.  Effective only with `enabled`.
    completion_receipts: bool = False
    # Beyond either bound, prepare reports the blocker `unacknowledged-results:N`
    # instead of letting the held results grow without limit.
    max_unacknowledged_results: int = Field(default=10_000, gt=0)
    max_unacknowledged_bytes: int = Field(default=256 * 1024 * 1024, gt=0)

    @model_validator(mode="after")
    def _token_when_enabled(self) -> CheckpointSettings:
        if self.enabled and (
            self.control_auth_token is None or not self.control_auth_token.get_secret_value()
        ):
            raise ValueError("checkpoint.control_auth_token is required when enabled is true")
        return self

    @property
    def token(self) -> str:
        """The bearer token; raises if checkpointing is off."""
        if self.control_auth_token is None:
            raise ValueError("checkpointing is not enabled: no control token")
        return self.control_auth_token.get_secret_value()


_POOL_KEYS = (
    "global_aiohttp_control_connector_limit",
    "global_aiohttp_control_connector_limit_per_host",
)


_INTERPOLATION = re.compile(r"\$\{[^}]*\}")


def _optional(annotation: Any) -> Any:
    return annotation | None


class _FromEnvironment(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")


# Every field of CheckpointSettings, optional and unset by default, read from
# RAY_CKPT_<FIELD>: built from the model so a new field is never forgotten here.
_EnvironmentSettings: type[BaseSettings] = create_model(  # type: ignore[call-overload]
    "_EnvironmentSettings",
    __base__=_FromEnvironment,
    **{
        name: (_optional(field.annotation), None)
        for name, field in CheckpointSettings.model_fields.items()
    },
)


def settings_from_env() -> dict[str, Any]:
    """The fields the environment sets (`RAY_CKPT_<FIELD>`), and only those."""
    return _EnvironmentSettings().model_dump(exclude_none=True)


def _plain(config: Any) -> Any:
    """An OmegaConf config as plain containers with every interpolation resolved."""
    if type(config).__module__.split(".")[0] != "omegaconf":
        return config
    from omegaconf import OmegaConf  # only ever given one by a user who has it

    try:
        return OmegaConf.to_container(config, resolve=True)
    except Exception as exc:  # omegaconf's own errors: name the key, not a value
        raise SettingsError(
            f"could not resolve the config's interpolations ({type(exc).__name__}: "
            f"{getattr(exc, 'full_key', None) or 'see the config'})"
        ) from None


def _through_omegaconf(data: dict[str, Any]) -> Any:
    """A YAML file's mapping as OmegaConf reads it, where OmegaConf is installed
    (as with NeMo Gym): its interpolations resolve as Hydra would resolve them."""
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return data  # a `${...}` left in the block is refused below
    return OmegaConf.create(data)


def _refuse_unresolved(block: Mapping[str, Any]) -> None:
    for key, value in block.items():
        if isinstance(value, str) and _INTERPOLATION.search(value):
            raise SettingsError(
                f"checkpoint.{key} is an unresolved interpolation: load the config "
                "through OmegaConf (or Hydra) so it is resolved, or give the value"
            )


def settings_from_dict(config: Mapping[str, Any], *, env: bool = False) -> CheckpointSettings:
    """Read the `checkpoint:` block of a global config (a dict or an OmegaConf
    config, interpolations resolved).

    The control pool limits live at the top level of a NeMo Gym global config;
    they are accepted there or inside the block.  With `env`, `RAY_CKPT_<FIELD>`
    variables fill in the fields the config leaves out.
    """
    config = _plain(config)
    if not isinstance(config, Mapping):
        raise SettingsError(f"expected a mapping at the top level, got {type(config).__name__}")
    block = dict(_plain(config.get("checkpoint")) or {})
    for key in _POOL_KEYS:
        if key in config and key not in block:
            block[key] = config[key]
    _refuse_unresolved(block)
    if env:
        block = {**settings_from_env(), **block}
    return CheckpointSettings.model_validate(block)


def load_settings(source: str | Path | Mapping[str, Any] | None = None) -> CheckpointSettings:
    """Settings from a YAML file path, a dict or an OmegaConf config, with the
    environment (`RAY_CKPT_<FIELD>`) filling in what it leaves out; `None`: the
    environment alone."""
    if source is None:
        data: Any = {}
    elif isinstance(source, str | Path):
        path = Path(source)
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise SettingsError(f"{path}: expected a mapping at the top level")
        data = _through_omegaconf(data)
    else:
        data = source
    return settings_from_dict(data, env=True)
