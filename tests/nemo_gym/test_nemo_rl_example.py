"""examples/nemo_rl_loop.py on the shared cluster: stand-ins with NeMo RL's
method signatures (the collector's pause()/resume() take no arguments), its
Gym server a Ray actor, checkpoints between training steps."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nemo_rl_loop.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("nemo_rl_loop", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stand_ins_have_nemo_rls_signatures() -> None:
    example = load_example()
    collector = example.AsyncTrajectoryCollector
    assert list(inspect.signature(collector.pause).parameters) == ["self"]
    assert list(inspect.signature(collector.resume).parameters) == ["self"]
    assert list(inspect.signature(collector.__init__).parameters) == [
        "self",
        "policy_generation",
        "tokenizer",
        "task_to_env",
        "master_config",
        "replay_buffer",
        "start_step",
    ]
    assert list(inspect.signature(collector.set_weight_version).parameters) == ["self", "version"]
    buffer = example.ReplayBuffer
    assert list(inspect.signature(buffer.push).parameters) == [
        "self",
        "trajectory",
        "step",
        "weight_version",
    ]
    assert list(inspect.signature(buffer.sample).parameters) == [
        "self",
        "batch_size",
        "current_weight_version",
        "max_age_steps",
    ]


def test_the_loop_checkpoints_with_the_collector_paused(namespace: str, tmp_path: Path) -> None:
    example = load_example()
    report = example.run(namespace, str(tmp_path), steps=4, every=2)
    assert len(report["metrics"]) == 4
    assert len(report["checkpoints"]) == 2
    # The coordinator paused and resumed the collector once per checkpoint, in order.
    assert report["collector"] == ["pause", "resume", "pause", "resume"]
    for ckpt in report["checkpoints"]:
        assert (Path(ckpt["dir"]) / "gym" / "_manifest.json").exists()
    # Games were in flight at some checkpoint, and they were continued.
    assert any(ckpt["continued"] for ckpt in report["checkpoints"])
