"""`python -m sammie serve` / `python -m qwen_engine serve`: the part of both CLIs that is not about the model.

`parse_set` reads repeated `--set key=value` options; `on_cuda` resolves the device a config will use;
`serve_locally` starts a fresh local Ray and Ray Serve, runs one app on host:port and blocks until Ctrl-C or SIGTERM,
then shuts both down. Ray and torch are imported inside the functions (engine_core itself imports neither).
"""

from __future__ import annotations

import sys
from typing import Any


def parse_set(items: list[str]) -> dict[str, Any]:
    """--set key=value (value parsed as YAML: 8 -> int, 5.0 -> float, null -> None, true -> bool)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def on_cuda(device: str | None) -> bool:
    """Whether a config with this `device` field runs on a GPU (None: cuda if available)."""
    import torch

    return (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve_locally(app, *, name: str, host: str, port: int, dashboard: bool, access_log: bool, banner: str) -> int:
    """Start a local Ray, Serve on host:port and `app` (a bound deployment); block until Ctrl-C (or SIGTERM), then
    shut down. Returns the process exit code."""
    import signal
    import time

    import ray
    from ray import serve

    ray.init(address="local", include_dashboard=dashboard)  # a fresh local Ray, never someone else's
    # After ray.init, which installs its own SIGTERM handler: a process manager's stop now shuts Serve and Ray down
    # cleanly, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": access_log})
        serve.run(app, name=name, route_prefix="/")
        print(banner, file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("shutting down", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
