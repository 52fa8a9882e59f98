"""The `checkpoint:` settings block (pydantic: settings are an edge).

Checkpointing is off by default; with it off, no server installs any
checkpoint route or behaviour.  The control token is required when it is on
and never appears in reprs, logs or dumps (`SecretStr`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


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
    # Incremental checkpoints (`ray_ckpt.storage.incremental`): a full rewrite
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


def settings_from_dict(config: dict[str, Any]) -> CheckpointSettings:
    """Read the `checkpoint:` block of a global config dict.

    The control pool limits live at the top level of a NeMo Gym global config;
    they are accepted there or inside the block.
    """
    block = dict(config.get("checkpoint") or {})
    for key in _POOL_KEYS:
        if key in config and key not in block:
            block[key] = config[key]
    return CheckpointSettings.model_validate(block)


def load_settings(path: str | Path) -> CheckpointSettings:
    """Read the `checkpoint:` block from a YAML file."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return settings_from_dict(data)
