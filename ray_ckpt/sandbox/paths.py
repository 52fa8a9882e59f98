"""Paths inside a sandbox: the checks that keep a provider's own reads and
writes inside its directory.

A path named by a caller (or by a snapshot read back from a checkpoint) is
relative POSIX, with no `..` and no absolute form; a symlink met on the way
must resolve inside the sandbox.  These checks protect what the provider
itself opens; they do not confine the sandbox's processes (those run as the
server's user, in no jail).
"""

from __future__ import annotations

import os
import re

from ray_ckpt.errors import SandboxPathEscape, SandboxRefused

# A sandbox id becomes a directory name, `<id>.g<generation>`: one safe
# component, short enough to stay within NAME_MAX (255) with its suffix.
MAX_NAME = 230
_NAME = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME - 1}}}$")


def relative(path: str) -> str:
    """`path` normalized ("a//./b/" -> "a/b"; the root is ""), or refused
    (`SandboxPathEscape`: absolute or through `..`)."""
    if "\0" in path:
        raise SandboxRefused(f"path {path!r} holds a NUL byte")
    if path.startswith("/"):
        raise SandboxPathEscape(f"path {path!r} is absolute; sandbox paths are relative")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise SandboxPathEscape(f"path {path!r} goes through '..'")
    return "/".join(parts)


def inside(real_root: str, path: str) -> bool:
    """Does `path` resolve (every symlink followed) inside `real_root`, itself
    already resolved?"""
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root + os.sep)


def resolve(root: str, path: str) -> str:
    """The absolute path `path` (relative, checked) names under `root`, its
    symlinks resolved; `SandboxPathEscape` if one leads outside."""
    rel = relative(path)
    real_root = os.path.realpath(root)
    full = os.path.join(real_root, rel) if rel else real_root
    real = os.path.realpath(full)
    if not (real == real_root or real.startswith(real_root + os.sep)):
        raise SandboxPathEscape(f"path {path!r} leads outside the sandbox through a symlink")
    return real


def check_name(name: str, what: str) -> str:
    """A name that becomes one directory component (an owner, a sandbox id)."""
    if not _NAME.match(name):
        raise SandboxRefused(
            f"{what} {name!r} is not a name [A-Za-z0-9][A-Za-z0-9._-]* "
            f"of at most {MAX_NAME} characters"
        )
    return name
