"""serve_configs/*.yaml: every key must be one Ray Serve 2.60 knows, every `args` key an EngineConfig field.

Ray's pydantic schemas ignore unknown keys (`DeploymentSchema(max_ongoing_requets=9)` is accepted and the value is
dropped; serving.md §5), so a typo silently falls back to a default. `unknown_keys` walks the YAML dict alongside the
schema models (ServeDeploySchema -> HTTPOptionsSchema, gRPCOptionsSchema, LoggingConfig, ServeApplicationSchema ->
DeploymentSchema -> AutoscalingConfig, RayActorOptionsSchema, BackpressureConfig, ...) and reports every key that is
not a field of the model it belongs to, plus deprecated or ignored ones; each level is also validated by its model.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing

import pytest

yaml = pytest.importorskip("yaml")
pydantic = pytest.importorskip("pydantic")
schema = pytest.importorskip("ray.serve.schema")
from ray.serve.config import AutoscalingConfig  # noqa: E402

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "serve_configs"
# Sammie's files; the Qwen app's (qwen_*.yaml) are checked by tests/test_qwen_serve.py with `unknown_keys` below.
CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.yaml") if not p.name.startswith("qwen_"))

# Fields the schema accepts but that do nothing useful here: refuse them in our files.
_DEPRECATED = "deprecated in Ray Serve 2.60 (serving.md 5.1)"
_IGNORED = "ignored in a multi-application config: http_options sets the proxies' host and port"
DISCOURAGED = {
    AutoscalingConfig: {k: _DEPRECATED for k in ("metrics_interval_s", "smoothing_factor",
                                                  "upscale_smoothing_factor", "downscale_smoothing_factor")},
    schema.ServeApplicationSchema: {"host": _IGNORED, "port": _IGNORED},
}

from sammie.engine import EngineConfig  # noqa: E402

ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def _models_in(annotation) -> list[type[pydantic.BaseModel]]:
    """Pydantic model classes anywhere inside a type annotation (Optional[X], Union[Dict, X], List[X], ...)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    out = []
    for arg in typing.get_args(annotation):
        out += _models_in(arg)
    return out


def _field_names(model: type[pydantic.BaseModel]) -> set[str]:
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return names


def unknown_keys(data: typing.Any, model: type[pydantic.BaseModel], path: str = "") -> list[str]:
    """Dotted paths of keys in `data` that `model` (recursively) does not define, or defines as deprecated."""
    problems: list[str] = []
    if not isinstance(data, dict):
        return [f"{path or '<root>'}: expected a mapping for {model.__name__}, got {type(data).__name__}"]
    known = _field_names(model)
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in known:
            problems.append(f"{where}: unknown key for {model.__name__}")
            continue
        if key in DISCOURAGED.get(model, {}):
            problems.append(f"{where}: {DISCOURAGED[model][key]}")
        sub = _models_in(model.model_fields[key].annotation)
        if not sub or value is None:
            continue  # a free-form dict (args, runtime_env, user_config, resources) or a scalar
        if isinstance(value, list):
            for i, item in enumerate(value):
                problems += unknown_keys(item, sub[0], f"{where}[{i}]")
        elif isinstance(value, dict):
            problems += unknown_keys(value, sub[0], where)
    if not problems:
        try:  # values too: types, ranges and cross-field rules of this level's model
            model.model_validate(data)
        except pydantic.ValidationError as e:
            problems.append(f"{path or '<root>'}: {model.__name__} rejects it: {e}")
    return problems


def engine_arg_problems(args: dict) -> list[str]:
    unknown = sorted(set(args) - set(ENGINE_FIELDS))
    problems = [f"args.{k}: not a sammie.engine.EngineConfig field" for k in unknown]
    if not problems:
        try:
            EngineConfig.from_dict(args)  # types and value checks (__post_init__); builds no model
        except (TypeError, ValueError) as e:
            problems.append(f"args: EngineConfig rejects them: {e}")
    return problems


def config_problems(cfg: dict) -> list[str]:
    problems = unknown_keys(cfg, schema.ServeDeploySchema)
    for i, app in enumerate(cfg.get("applications") or []):
        problems += [f"applications[{i}].{p}" for p in engine_arg_problems(app.get("args") or {})]
    return problems


def _load(path: pathlib.Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


# ------------------------------------------------------------------------------------------------------ tests


def test_config_files_exist():
    names = {p.name for p in CONFIGS}
    assert {"local.yaml", "cluster.yaml"} <= names, names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_key_is_known(path):
    cfg = _load(path)
    assert config_problems(cfg) == []
    # What `serve run` does with the file, end to end through Ray's parser.
    parsed = schema.ServeDeploySchema.model_validate(cfg)
    assert [a.import_path for a in parsed.applications] == ["sammie.serve:build_app"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_sized_to_the_engine(path):
    """The relations the YAML comments promise (serving.md 2.1, 2.2, 3, 4)."""
    cfg = _load(path)
    timeout_proxy = cfg["http_options"]["request_timeout_s"]
    assert cfg["logging_config"]["enable_access_log"] is False
    for app in cfg["applications"]:
        args = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
        args.update(app["args"])
        (dep,) = app["deployments"]
        mor = dep["max_ongoing_requests"]
        # A batch never exceeds the requests in flight: leave room for one batch running and one forming.
        assert mor >= 2 * args["max_image_batch"], "max_ongoing_requests cannot fill the engine's batches"
        # Ray's limit binds before the engine's own admission limit in normal operation.
        assert args["max_queued"] >= mor
        assert dep["max_queued_requests"] > 0, "an unbounded proxy queue grows without limit under overload"
        # The engine answers 504 before the proxy's 408 backstop; shutdown waits for admitted requests.
        assert args["request_timeout_s"] < timeout_proxy
        assert dep["graceful_shutdown_timeout_s"] > args["request_timeout_s"]
        assert dep["health_check_timeout_s"] >= dep["health_check_period_s"]
        gpus = dep["ray_actor_options"]["num_gpus"]
        assert gpus in (0, 1)
        if gpus == 1:
            assert args["device"] in (None, "cuda")
        if "autoscaling_config" in dep:
            auto = dep["autoscaling_config"]
            assert "num_replicas" not in dep, "num_replicas and autoscaling_config conflict"
            assert auto["min_replicas"] <= auto.get("initial_replicas", auto["min_replicas"]) <= auto["max_replicas"]
            # The autoscaler's target must be reachable and not below one full batch.
            assert args["max_image_batch"] <= auto["target_ongoing_requests"] < mor
            assert gpus == 1, "one replica per GPU"
        else:
            assert dep["num_replicas"] == 1


def test_local_config_runs_without_a_gpu():
    cfg = _load(CONFIG_DIR / "local.yaml")
    dep = cfg["applications"][0]["deployments"][0]
    assert dep["ray_actor_options"]["num_gpus"] == 0
    assert cfg["applications"][0]["args"]["device"] in (None, "cpu")
    assert cfg["http_options"]["host"] == "127.0.0.1"


def test_deployment_names_match_the_app():
    """A `deployments:` entry must name a deployment of the app (Ray refuses unknown names only at deploy time)."""
    serve_mod = pytest.importorskip("sammie.serve")
    for path in CONFIGS:
        for app_cfg in _load(path)["applications"]:
            app = serve_mod.build_app(app_cfg["args"])
            names = _deployment_names(app)
            for dep in app_cfg["deployments"]:
                assert dep["name"] in names, (path.name, dep["name"], names)


def _deployment_names(app) -> set[str]:
    """Names of the deployments bound into an Application (the ingress and anything passed to .bind())."""
    names, todo, seen = set(), [app._bound_deployment], set()
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        names.add(d.name)
        for a in [*getattr(d, "init_args", ()), *getattr(d, "init_kwargs", {}).values()]:
            inner = getattr(a, "_bound_deployment", None)
            if inner is not None:
                todo.append(inner)
    return names


# ---------------------------------------------------------------------------------------- negative tests


def _local() -> dict:
    return _load(CONFIG_DIR / "local.yaml")


def _cluster() -> dict:
    return _load(CONFIG_DIR / "cluster.yaml")


@pytest.mark.parametrize(
    "mutate, expect, ray_is_silent",
    [
        (lambda c: c["applications"][0]["deployments"][0].__setitem__("max_ongoing_request", 8),
         "deployments[0].max_ongoing_request: unknown key for DeploymentSchema", True),
        (lambda c: c["applications"][0]["deployments"][0].__setitem__("num_replica", 2),
         "deployments[0].num_replica: unknown key", True),
        (lambda c: c["applications"][0]["deployments"][0].__setitem__("max_concurrent_queries", 8),  # removed in 2.x
         "max_concurrent_queries: unknown key", True),
        (lambda c: c["applications"][0]["deployments"][0]["ray_actor_options"].__setitem__("num_gpu", 1),
         "ray_actor_options.num_gpu: unknown key for RayActorOptionsSchema", True),
        (lambda c: c["http_options"].__setitem__("request_timeout", 5),
         "http_options.request_timeout: unknown key for HTTPOptionsSchema", True),
        (lambda c: c.__setitem__("proxy_locaton", "HeadOnly"), "proxy_locaton: unknown key for ServeDeploySchema",
         True),
        (lambda c: c["applications"][0].__setitem__("import_paht", "x:y"), "import_paht: unknown key", True),
        (lambda c: c["applications"][0]["args"].__setitem__("max_image_batchsize", 4),
         "args.max_image_batchsize: not a sammie.engine.EngineConfig field", True),
        # LoggingConfig (extra="forbid") and bad values Ray does refuse; we report them the same way.
        (lambda c: c["logging_config"].__setitem__("enable_access_logs", False),
         "logging_config.enable_access_logs: unknown key for LoggingConfig", False),
        (lambda c: c["applications"][0]["deployments"][0].__setitem__("max_ongoing_requests", "lots"),
         "DeploymentSchema rejects it", False),
    ],
)
def test_misspelled_keys_are_caught(mutate, expect, ray_is_silent):
    cfg = _local()
    mutate(cfg)
    problems = config_problems(cfg)
    assert any(expect in p for p in problems), problems
    if ray_is_silent:  # ...which Ray's own parser (what `serve run` uses) would have let through
        schema.ServeDeploySchema.model_validate(cfg)
    else:
        with pytest.raises(pydantic.ValidationError):
            schema.ServeDeploySchema.model_validate(cfg)


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda d: d["autoscaling_config"].__setitem__("target_num_ongoing_requests_per_replica", 4),
         "autoscaling_config.target_num_ongoing_requests_per_replica: unknown key for AutoscalingConfig"),
        (lambda d: d["autoscaling_config"].__setitem__("max_replica", 4), "max_replica: unknown key"),
        (lambda d: d["autoscaling_config"].__setitem__("metrics_interval_s", 5), "metrics_interval_s: deprecated"),
        (lambda d: d["backpressure_config"].__setitem__("retry_after", 5), "retry_after: unknown key"),
    ],
)
def test_misspelled_nested_keys_are_caught(mutate, expect):
    cfg = _cluster()
    mutate(cfg["applications"][0]["deployments"][0])
    problems = config_problems(cfg)
    assert any(expect in p for p in problems), problems


def test_bad_engine_values_are_caught():
    cfg = _local()
    cfg["applications"][0]["args"]["max_image_batch"] = "8"  # a string where an int belongs
    assert any("EngineConfig rejects" in p for p in config_problems(cfg))
    cfg = _local()
    cfg["applications"][0]["args"]["config"] = "sam4"
    assert any("EngineConfig rejects" in p for p in config_problems(cfg))
