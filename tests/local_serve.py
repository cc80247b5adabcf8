"""One local Ray Serve instance per test module (the serving tests of both engines): a free port, a fresh local Ray,
the given apps, and a clean shutdown."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_serve(apps: dict[str, tuple[str, object]], **ray_init_kwargs) -> Iterator[str]:
    """Serve `apps` ({route_prefix: (name, bound app)}) on a fresh local Ray (2 CPUs, no dashboard, access log
    off); yields the base URL. `ray_init_kwargs` go to `ray.init` (e.g. `_metrics_export_port`)."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, **ray_init_kwargs)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False})
        for prefix, (name, app) in apps.items():
            serve.run(app, name=name, route_prefix=prefix)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
