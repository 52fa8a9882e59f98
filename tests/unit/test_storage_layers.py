"""The rooms of `ray_ckpt` import one way, hidden imports included.

`ray_ckpt.storage` is four rooms, lowest first: `blobstore` (bytes and
locations), `records` (the records format), `participant` (one participant's
files), `root` (the Gym manifest, LATEST, the catalog, retention).  A room
imports only itself and the rooms below it, and never the package's face
(`ray_ckpt.storage` itself, `seam`), which sits above them all.  Every import
counts, at module level, under `TYPE_CHECKING` or inside a function: the
graph is `test_controller_layers.import_graph`.
"""

from __future__ import annotations

from tests.unit.test_controller_layers import import_graph

STORAGE = "ray_ckpt.storage"
ROOMS = ("blobstore", "records", "participant", "root")
# The package's face: what users and the controller import; above every room.
FACE = {STORAGE, f"{STORAGE}.seam"}


def _room(module: str) -> int | None:
    """The rank of the room `module` is in, or None outside the rooms."""
    prefix = f"{STORAGE}."
    if not module.startswith(prefix):
        return None
    room = module[len(prefix) :].split(".")[0]
    return ROOMS.index(room) if room in ROOMS else None


def room_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a room imports a room above it or the face."""
    bad = []
    for module, targets in graph.items():
        rank = _room(module)
        if rank is None:
            continue
        for target in targets:
            if not target.startswith(STORAGE):
                continue
            other = _room(target)
            if other is None or other > rank:
                bad.append((module, target))
    return sorted(bad)


def importers(graph: dict[str, set[str]], of: str, in_: str) -> list[str]:
    """Modules under `in_` that import anything under `of`."""
    return sorted(
        m
        for m, targets in graph.items()
        if (m == in_ or m.startswith(f"{in_}."))
        and any(t == of or t.startswith(f"{of}.") for t in targets)
    )


def test_every_storage_module_is_in_a_room_or_the_face() -> None:
    loose = sorted(
        m for m in import_graph() if m.startswith(STORAGE) and m not in FACE and _room(m) is None
    )
    assert loose == []


def test_each_storage_room_imports_only_itself_and_rooms_below() -> None:
    assert room_violations(import_graph()) == []


def test_the_room_check_flags_an_upward_import_and_one_of_the_face() -> None:
    graph = {
        f"{STORAGE}.records.record": {f"{STORAGE}.blobstore.blobs", f"{STORAGE}.records.x"},
        f"{STORAGE}.blobstore.blobs": {f"{STORAGE}.root.catalog"},
        f"{STORAGE}.participant.p": {STORAGE},
        f"{STORAGE}.seam": {f"{STORAGE}.root.catalog"},
    }
    assert room_violations(graph) == [
        (f"{STORAGE}.blobstore.blobs", f"{STORAGE}.root.catalog"),
        (f"{STORAGE}.participant.p", STORAGE),
    ]


def test_steps_does_not_import_the_control_plane() -> None:
    # What both speak (`PrepareReport`, `Blocker`, `Receipt`: `ray_ckpt.reports`;
    # the retire marks: `ray_ckpt.steps.retire_marks`) lives below both.
    assert importers(import_graph(), of="ray_ckpt.control", in_="ray_ckpt.steps") == []


def test_what_participants_report_imports_neither_steps_nor_control() -> None:
    graph = import_graph()
    assert not any(
        t.startswith(("ray_ckpt.steps", "ray_ckpt.control")) for t in graph["ray_ckpt.reports"]
    )


def test_the_hosting_imports_the_workers_and_never_the_reverse() -> None:
    # The host starts its worker plane; what both need (`ServerSpec`, serving
    # an app) is `ray_ckpt.gym_server`, which imports neither.
    graph = import_graph()
    assert importers(graph, of="ray_ckpt.hosting", in_="ray_ckpt.workers") == []
    assert importers(graph, of="ray_ckpt.hosting", in_="ray_ckpt.gym_server") == []
    assert importers(graph, of="ray_ckpt.workers", in_="ray_ckpt.gym_server") == []
    assert "ray_ckpt.workers.plane" in graph["ray_ckpt.hosting.host"]
