"""Autotune picks saved from one GPU run and loaded before the next start, so that a fresh machine neither benchmarks
nor compiles every configuration of the autotuned kernels again.

Why: on a fresh H200 (empty Triton cache) the Qwen engine's first start took more than 560 s (benchmarks/RESULTS.md,
runs 21-23): each autotuned kernel compiles and times every configuration for every new key (decode bucket x shape)
in the warm-up; with the cache warm the same start took 42-44 s. A table of the picks pre-fills each autotuner's
`cache` (Triton's own in-memory `{key: Config}`), so only the picked configuration of each key is compiled and
nothing is timed; keys the table lacks are tuned as before.

Table (JSON, one per GPU model: `kernels/tuned/<device name>.json`, written by `dump`): {"device", "triton", "kernels":
{name: [[key, config], ...]}} with Triton's key -- the kernel's `key=` argument values, then the dtype of every tensor
argument, in order (`triton.runtime.autotuner.Autotuner.run`, the same in triton 3.6 and 3.8) -- and the config's
kwargs, num_warps, num_stages, num_ctas, maxnreg. Loaded only onto the GPU model it was measured on. Every config of
these kernels is a correct one (their tests run them); a table only chooses among them. A table naming a kernel or a
configuration the code no longer has is refused (ValueError at the engine's start: regenerate it). Loading is
process-wide and first-wins (the autotuners are module globals).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TABLE_DIR = Path(__file__).with_name("tuned")
# name -> (module, attribute) of each autotuned kernel (a `triton.runtime.autotuner.Autotuner`)
AUTOTUNED = {
    "w4a16_dense": ("kernels.w4a16_gemm", "_w4a16_dense_kernel"),
    "w4a16_grouped": ("kernels.w4a16_gemm", "_w4a16_grouped_kernel"),
    "w4a16_gemv": ("kernels.w4a16_gemv", "_w4a16_gemv_autotuned"),
    "fp8_gemv": ("kernels.fp8_gemv", "_fp8_gemv_autotuned"),
    "fp8_skinny": ("kernels.fp8_skinny", "_fp8_skinny_autotuned"),
    "moe_decode": ("kernels.moe_decode", "_moe_decode_autotuned"),  # moe_fused_decode (off); no picks shipped yet
    "w4a16_mma": ("kernels.w4a16_mma", "_w4a16_mma_autotuned"),  # the routed experts' decode GEMV (mma_picks.py)
}
_CONFIG_FIELDS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def autotuners() -> dict[str, Any]:
    """name -> the Autotuner object (empty without triton)."""
    out = {}
    for name, (module, attr) in AUTOTUNED.items():
        tuner = getattr(importlib.import_module(module), attr, None)
        if tuner is not None and hasattr(tuner, "cache"):
            out[name] = tuner
    return out


def table_path(device_name: str) -> Path:
    """kernels/tuned/<device name, lower case, non-alphanumerics as '_'>.json."""
    return TABLE_DIR / (re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_") + ".json")


def _config_json(config) -> dict:
    return {"kwargs": dict(config.kwargs), **{f: getattr(config, f, None) for f in _CONFIG_FIELDS}}


def dump(device_name: str, path: str | Path | None = None) -> dict:
    """Every autotuner's picks so far (this process) as a table for `device_name`; written to `path` if given."""
    import triton

    kernels = {name: [[list(key), _config_json(cfg)] for key, cfg in list(tuner.cache.items())]
               for name, tuner in autotuners().items() if tuner.cache}
    table = {"device": device_name, "triton": triton.__version__, "kernels": kernels}
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # whole or absent should the process be killed mid-write; a name per process and thread (benchmarks dump
        # from a timer thread and from the main one)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        tmp.replace(path)
    return table


def load(table: dict | str | Path, device_name: str) -> int:
    """Pre-fill the autotuners' caches from `table` (a dict or a JSON file) when it was measured on `device_name`;
    keys already tuned in this process are kept. Returns the number of picks loaded (0 for another GPU model, logged).
    A malformed table, an unknown kernel or a configuration the kernel does not list raise ValueError."""
    import triton

    if not isinstance(table, dict):
        try:
            table = json.loads(Path(table).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"autotune table {table}: cannot read it ({exc})") from exc
    if not isinstance(table, dict) or not isinstance(table.get("kernels"), dict) or "device" not in table:
        raise ValueError("autotune table: expected {'device': ..., 'triton': ..., 'kernels': {name: [[key, config]]}}")
    if table["device"] != device_name:
        log.info("autotune table for %s not loaded on %s", table["device"], device_name)
        return 0
    tuners = autotuners()
    resolved = []  # every pick checked before any cache is touched: a refused table leaves the autotuners as they were
    for name, picks in table["kernels"].items():
        if name not in tuners:
            raise ValueError(f"autotune table: unknown kernel {name!r} (known: {sorted(tuners)})")
        if not isinstance(picks, list):
            raise ValueError(f"autotune table: {name}: expected a list of [key, config] pairs, got {picks!r}")
        tuner = tuners[name]
        listed = {json.dumps(_config_json(c), sort_keys=True): c for c in tuner.configs}
        for pick in picks:
            if not (isinstance(pick, list) and len(pick) == 2 and isinstance(pick[0], list)
                    and all(isinstance(v, (int, float, str, bool)) or v is None for v in pick[0])):
                raise ValueError(f"autotune table: {name}: expected [key, config] pairs with scalar keys, got "
                                 f"{pick!r}")
            key, cfg = pick
            config = listed.get(json.dumps(cfg, sort_keys=True))
            if config is None:  # the kernel's configurations changed since the table was written
                raise ValueError(f"autotune table: {name} has no configuration {cfg} (regenerate the table)")
            resolved.append((tuner, tuple(key), config))
    n = 0
    for tuner, key, config in resolved:
        if key not in tuner.cache:
            tuner.cache[key] = config
            n += 1
    log.info("autotune table: %d picks for %s (measured with triton %s; this is %s)", n, device_name,
             table.get("triton"), triton.__version__)
    return n


def load_foreign(path: str | Path) -> tuple[int, str]:
    """`load` the JSON table at `path` whatever GPU model measured it (its own device name): another model's picks,
    e.g. the H200's on an H100, for a side-by-side run without the start-up tuning (an H100's cold start tuned the
    decode graphs' shapes for over 400 s: RESULTS.md, forty-seventh session). Not for serving: picks are only this
    model's best where `load` accepts them. Returns (picks loaded, the table's device)."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"autotune table {path}: cannot read it ({exc})") from exc
    if not isinstance(table, dict) or "device" not in table:
        raise ValueError(f"autotune table {path}: no 'device' field")
    return load(table, table["device"]), table["device"]


def override(picks: list[dict]) -> dict:
    """Replace picks already in the autotuners' caches, for a side-by-side run of other picks in one process
    (benchmarks/qwen_gpu.py --variant '{"picks": [...]}'; a table's load keeps a process's picks, so it cannot).
    Each pick: {"kernel": name, "key": a prefix of Triton's key tuple, "config": {"kwargs": {...}, "num_warps": n,
    ...}} (the config fields given must match one of the kernel's configurations; those left out match any). Every
    cached key of that kernel starting with the prefix takes the configuration. Returns what it replaced, for
    `restore`. A pick that names an unknown kernel, matches no cached key, or no configuration raises ValueError, and
    then nothing is replaced."""
    tuners = autotuners()
    changes = []
    for pick in picks:
        name, prefix, want = pick.get("kernel"), list(pick.get("key", [])), pick.get("config", {})
        if name not in tuners:
            raise ValueError(f"autotune override: unknown kernel {name!r} (known: {sorted(tuners)})")
        tuner = tuners[name]
        configs = [c for c in tuner.configs
                   if all(_config_json(c).get(f) == v for f, v in want.items())]
        if len(configs) != 1:
            raise ValueError(f"autotune override: {name}: {want} matches {len(configs)} configurations, not one")
        keys = [k for k in tuner.cache if list(k[:len(prefix)]) == prefix]
        if not keys:
            raise ValueError(f"autotune override: {name}: no tuned key starts with {prefix}")
        changes += [(tuner, k, configs[0]) for k in keys]
    saved = {}
    for tuner, key, config in changes:
        saved.setdefault((id(tuner), key), (tuner, key, tuner.cache[key]))
        tuner.cache[key] = config
    return saved


def restore(saved: dict) -> None:
    """Put back the picks `override` replaced."""
    for tuner, key, config in saved.values():
        tuner.cache[key] = config


def load_for_device(device) -> int:
    """`load` the shipped table of this CUDA device's model, if there is one (0 otherwise, and off CUDA)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return 0
    name = torch.cuda.get_device_name(device)
    path = table_path(name)
    return load(path, name) if path.exists() else 0


def load_setting(setting: str, device) -> int:
    """An autotune_table setting (QwenEngineConfig's, benchmarks/qwen_gpu.py --autotune-table) onto the autotuners:
    "off" or a device other than CUDA: nothing; "auto": the shipped table (`load_for_device`), a stale one logged and
    skipped (the kernels then tune at start); a JSON path: `load`, whose errors stand. The number of picks loaded."""
    import torch

    device = torch.device(device)
    if setting == "off" or device.type != "cuda":
        return 0
    if setting == "auto":
        try:
            return load_for_device(device)
        except ValueError as exc:  # a stale shipped table: tune as without one (a named table's error stands)
            log.warning("%s; the autotuned kernels tune at start instead", exc)
            return 0
    return load(setting, torch.cuda.get_device_name(device))
