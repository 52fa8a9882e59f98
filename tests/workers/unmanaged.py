"""A server with several worker processes and no `ray_ckpt.workers`: what
`uvicorn --workers N` does to a sidecar-mode server.

``python -m tests.workers.unmanaged N [aiohttp|fastapi]`` binds one port,
forks N processes that each serve the tiny table server with the in-process
integration (a engine each) on it (FastAPI: under uvicorn, with the
ASGI control middleware), prints ``URL <base> <pid>,<pid>..`` (its workers) once every one of them
serves (before that, one slow to start would leave every connection to the
others, and the server would look like one process), and ends them all when
its stdin closes.  Settings come as JSON in `RAY_CKPT_TEST_SETTINGS`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from ray_ckpt.gym_server.serving import bind_socket, serve_app, socket_address
from ray_ckpt.hosting.sidecar import install_sidecar, wrap_asgi_sidecar
from ray_ckpt.settings import CheckpointSettings
from tests.servers import SETTINGS_ENV, AiohttpTableServer, FastAPITableServer


async def _child(sock_fd: int, ready_fd: int, framework: str) -> None:
    import socket

    settings = CheckpointSettings.model_validate_json(os.environ.get(SETTINGS_ENV, "{}"))
    sock = socket.socket(fileno=sock_fd)
    if framework == "fastapi":
        asgi = FastAPITableServer("environment", "unmanaged")
        wrapped, _ = wrap_asgi_sidecar(asgi.app(), asgi.participant, settings, instance="unmanaged")
        await serve_app(wrapped, sock, drain_s=0.5)
    else:
        server = AiohttpTableServer("environment", "unmanaged")
        app = server.app()
        install_sidecar(app, server.participant, settings, instance="unmanaged")
        await serve_app(app, sock, drain_s=0.5)
    os.write(ready_fd, b"r")
    os.close(ready_fd)
    await asyncio.Event().wait()


def main() -> None:
    workers = int(sys.argv[1])
    framework = sys.argv[2] if len(sys.argv) > 2 else "aiohttp"
    sock = bind_socket("127.0.0.1", 0)
    host, port = socket_address(sock)
    children = []
    ready_r, ready_w = os.pipe()
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            asyncio.run(_child(sock.fileno(), ready_w, framework))
            os._exit(0)
        children.append(pid)
    os.close(ready_w)
    for _ in range(workers):
        assert os.read(ready_r, 1) == b"r", "a worker exited before it served"
    print(f"URL http://{host}:{port} {','.join(map(str, children))}", flush=True)
    sys.stdin.read()
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
