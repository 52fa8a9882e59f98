"""Which Gym the last complete checkpoint (or restore) was of, so an
unattended checkpoint never publishes a different one as `latest`.

After a crash of some Gym servers, discovery drops the dead members and a
relaunch registers fresh processes under the same names.  A periodic or
signal checkpoint taken then would be complete — of the survivors, or with
fresh replacements holding nothing — and would become `latest`, hiding the
checkpoint the Gym should be restored from (a restore of it into the full
fleet is then refused, or continues nothing of the lost servers' episodes).
So the coordinator remembers each member of the last complete checkpoint or
restore and which process it was (a Ray actor's ID; an HTTP participant's
process cannot be told apart, so only its absence counts), and refuses an
unattended checkpoint while one of them is gone or replaced
(`MembershipChanged`).  A restore, or a checkpoint a person asks for
(trigger `manual`), accepts the Gym as it is now.  Pure: no Ray, no I/O.

Every trigger but `manual` is unattended, a drain's too: a drain notice
after a member died would otherwise checkpoint the survivors, publish them as
`latest` and re-baseline on them, and the periodic loop's `keep_latest_k`
would then delete the last checkpoint of the whole Gym.  The guard is an
allow-list of the one attended trigger, so a trigger added to `Trigger`
later is unattended unless someone decides otherwise here.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from ray_ckpt.errors import MembershipChanged


class Trigger(StrEnum):
    """What started a checkpoint: the one list of them (metrics labels too)."""

    MANUAL = "manual"  # a person asked for it
    PERIODIC = "periodic"
    SIGNAL = "signal"
    DRAIN = "drain"


# The checkpoints a person starts, who may accept a changed Gym; any other
# trigger (a string not in `Trigger` too) is unattended.
ATTENDED = frozenset({Trigger.MANUAL})


def attended(trigger: str) -> bool:
    return trigger in ATTENDED


def identity(host: Any) -> str | None:
    """Which process answers for `host`: a Ray host's actor ID
    (`RayHost.identity`), a test double's own; None: unknown (HTTP)."""
    own = getattr(host, "identity", None)
    return own if isinstance(own, str) else None


class GymBaseline:
    def __init__(self) -> None:
        self.members: dict[str, str | None] | None = None  # None: nothing complete yet
        # Members dropped since the last complete checkpoint or restore (their
        # process was found gone, or they were unregistered).  Refused even
        # before anything completed: the first unattended checkpoint after a
        # death would otherwise publish the survivors as `latest`, and a
        # relaunch under the same name holds nothing of what was lost.
        self.lost: set[str] = set()

    def record(self, hosts: Mapping[str, Any]) -> None:
        """The members of a checkpoint or restore that just completed."""
        self.members = {key: identity(host) for key, host in hosts.items()}
        self.lost = set()

    def member_lost(self, key: str) -> None:
        self.lost.add(key)

    def check(self, hosts: Mapping[str, Any], trigger: str) -> None:
        """Refuse an unattended checkpoint of a Gym that lost or replaced a member."""
        if attended(trigger):
            return
        members = self.members or {}
        gone = sorted(self.lost | {k for k in members if k not in hosts})
        replaced = sorted(
            k
            for k, was in members.items()
            if k in hosts and k not in self.lost and was is not None and identity(hosts[k]) != was
        )
        if gone or replaced:
            what = "; ".join(
                f"{label}: {', '.join(keys)}"
                for label, keys in (("gone", gone), ("replaced", replaced))
                if keys
            )
            raise MembershipChanged(
                f"a {trigger} checkpoint now would publish another Gym than the last "
                f"complete checkpoint's ({what}); restore the Gym (or take a manual "
                "checkpoint to accept it as it is) first"
            )
