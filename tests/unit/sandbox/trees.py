"""What the sandbox tests compare: a tree as data, the content store as a listing."""

from __future__ import annotations

import os
import pathlib
import stat


def listing(tree: pathlib.Path) -> dict[str, tuple[str, int, bytes | str | None]]:
    """path -> (kind, permission bits, bytes of a file | a symlink's target | None)."""
    out: dict[str, tuple[str, int, bytes | str | None]] = {}
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in [*dirnames, *filenames]:
            full = pathlib.Path(dirpath, name)
            rel = full.relative_to(tree).as_posix()
            st = full.lstat()
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("symlink", 0, os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", mode, None)
            else:
                out[rel] = ("file", mode, full.read_bytes())
    return out


def stored(root: pathlib.Path) -> set[str]:
    """The digests in the provider's content store (no temporary files)."""
    return {p.name for p in (root / "cas").iterdir() if not p.name.startswith(".")}


def trees(root: pathlib.Path) -> set[str]:
    """The sandbox trees under the root, temporary ones included."""
    return {p.name for p in (root / "trees").iterdir()}
