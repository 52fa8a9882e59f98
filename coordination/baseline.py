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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray_ckpt.errors import MembershipChanged

# Checkpoints nobody watches as they start: refused while the Gym changed.
UNATTENDED = frozenset({"periodic", "signal"})


def identity(host: Any) -> str | None:
    """Which process answers for `host`: a Ray host's actor ID
    (`RayHost.identity`), a test double's own; None: unknown (HTTP)."""
    own = getattr(host, "identity", None)
    return own if isinstance(own, str) else None


class GymBaseline:
    def __init__(self) -> None:
        self.members: dict[str, str | None] | None = None  # None: nothing complete yet

    def record(self, hosts: Mapping[str, Any]) -> None:
        """The members of a checkpoint or restore that just completed."""
        self.members = {key: identity(host) for key, host in hosts.items()}

    def check(self, hosts: Mapping[str, Any], trigger: str) -> None:
        """Refuse an unattended checkpoint of a Gym that lost or replaced a member."""
        if trigger not in UNATTENDED or self.members is None:
            return
        gone = sorted(k for k in self.members if k not in hosts)
        replaced = sorted(
            k
            for k, was in self.members.items()
            if k in hosts and was is not None and identity(hosts[k]) != was
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
