"""A server with several worker processes and no `ray_ckpt.workers`: what
`uvicorn --workers N` does to a sidecar-mode server.

``python -m tests.workers.unmanaged N`` binds one port, forks N processes
that each serve the tiny table server with the in-process integration (a
controller each) on it, prints ``URL <base>`` once every one of them
serves (before that, one slow to start would leave every connection to the
others, and the server would look like one process), and ends them all when
its stdin closes.  Settings come as JSON in `RAY_CKPT_TEST_SETTINGS`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from ray_ckpt.hosting.serving import bind_socket, serve_app, socket_address
from ray_ckpt.hosting.sidecar import install_sidecar
from ray_ckpt.settings import CheckpointSettings
from tests.servers import SETTINGS_ENV, AiohttpTableServer


async def _child(sock_fd: int, ready_fd: int) -> None:
    import socket

    settings = CheckpointSettings.model_validate_json(os.environ.get(SETTINGS_ENV, "{}"))
    server = AiohttpTableServer("environment", "unmanaged")
    app = server.app()
    install_sidecar(app, server.participant, settings, instance="unmanaged")
    await serve_app(app, socket.socket(fileno=sock_fd), drain_s=0.5)
    os.write(ready_fd, b"r")
    os.close(ready_fd)
    await asyncio.Event().wait()


def main() -> None:
    workers = int(sys.argv[1])
    sock = bind_socket("127.0.0.1", 0)
    host, port = socket_address(sock)
    children = []
    ready_r, ready_w = os.pipe()
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            asyncio.run(_child(sock.fileno(), ready_w))
            os._exit(0)
        children.append(pid)
    os.close(ready_w)
    for _ in range(workers):
        assert os.read(ready_r, 1) == b"r", "a worker exited before it served"
    print(f"URL http://{host}:{port}", flush=True)
    sys.stdin.read()
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
