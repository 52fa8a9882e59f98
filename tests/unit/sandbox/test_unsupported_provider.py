"""The test provider that declares UNSUPPORTED (`tests.sandbox_providers`):
it serves sandboxes but refuses every snapshot, and no checkpoint claims one."""

from __future__ import annotations

import pathlib

import pytest

from ray_ckpt.errors import SandboxUnsupported
from ray_ckpt.sandbox import SandboxCapability, SandboxProvider, SandboxSnapshot
from tests.sandbox_providers import UnsupportedSandbox


async def test_it_serves_sandboxes_but_refuses_capture_and_restore(
    tmp_path: pathlib.Path,
) -> None:
    provider = UnsupportedSandbox(tmp_path / "root")
    try:
        assert isinstance(provider, SandboxProvider)
        assert provider.capability is SandboxCapability.UNSUPPORTED
        h = await provider.create("r1")
        await provider.write_file(h, "f", b"x")
        assert (await provider.run(h, ["cat", "f"], timeout_s=10)).stdout == "x"
        with pytest.raises(SandboxUnsupported):
            await provider.capture(h)
        snapshot = SandboxSnapshot(
            provider="unsupported",
            capability=SandboxCapability.UNSUPPORTED,
            sandbox_id=h.sandbox_id,
            generation=0,
        )
        with pytest.raises(SandboxUnsupported):
            await provider.restore([(snapshot, {})])
        assert (provider.captures, provider.restores) == (1, 1)
        await provider.free(h)
        assert not (tmp_path / "root" / "trees" / f"{h.sandbox_id}.g0").exists()
    finally:
        await provider.close()


@pytest.mark.parametrize("live", [False, True])
def test_what_each_capability_lets_a_checkpoint_claim(live: bool) -> None:
    assert SandboxCapability.UNSUPPORTED.continues(live_process=live) is False
    assert SandboxCapability.FILESYSTEM.continues(live_process=live) is (not live)
    assert SandboxCapability.LIVE.continues(live_process=live) is True
