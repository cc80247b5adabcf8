"""kernels/autotune_table.py: autotune picks dumped from the autotuners' caches and loaded back before a start, only
onto the GPU model they were measured on, with clear errors for a table that does not fit the kernels."""

import json

import pytest
import torch

from kernels import autotune_table

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


@pytest.fixture
def clean_caches():
    """Each autotuner's cache emptied for the test and restored after it."""
    saved = {name: dict(t.cache) for name, t in autotune_table.autotuners().items()}
    for t in autotune_table.autotuners().values():
        t.cache.clear()
    yield autotune_table.autotuners()
    for name, t in autotune_table.autotuners().items():
        t.cache.clear()
        t.cache.update(saved[name])


def test_every_listed_kernel_is_an_autotuner():
    assert set(autotune_table.autotuners()) == set(autotune_table.AUTOTUNED)


def test_table_path():
    assert autotune_table.table_path("NVIDIA H200").name == "nvidia_h200.json"
    assert autotune_table.table_path("NVIDIA H100 80GB HBM3").name == "nvidia_h100_80gb_hbm3.json"


def test_dump_then_load_restores_the_picks(clean_caches, tmp_path):
    gemv = clean_caches["w4a16_gemv"]
    key = (1024, 2048, 1, True, True, False, 2, "torch.bfloat16", "torch.uint8", "torch.float32")
    gemv.cache[key] = gemv.configs[3]
    table = autotune_table.dump("NVIDIA H200", tmp_path / "t.json")
    assert table["kernels"] == {"w4a16_gemv": [[list(key), autotune_table._config_json(gemv.configs[3])]]}
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(table))
    gemv.cache.clear()
    assert autotune_table.load(tmp_path / "t.json", "NVIDIA H100") == 0 and not gemv.cache  # another GPU model
    assert autotune_table.load(tmp_path / "t.json", "NVIDIA H200") == 1
    assert gemv.cache == {key: gemv.configs[3]}  # the kernel's own Config object, under Triton's key tuple
    gemv.cache[key] = gemv.configs[0]  # a key tuned in this process is kept
    assert autotune_table.load(table, "NVIDIA H200") == 0 and gemv.cache[key] is gemv.configs[0]


def test_load_foreign_takes_another_models_table(clean_caches, tmp_path):
    """`load_foreign` (benchmarks' --autotune-foreign) loads a table whatever GPU model it names -- the one `load`
    refused on another model -- and still refuses a file that is not a table."""
    gemv = clean_caches["w4a16_gemv"]
    key = (1024, 2048, 1, True, True, False, 2, "torch.bfloat16", "torch.uint8", "torch.float32")
    gemv.cache[key] = gemv.configs[2]
    autotune_table.dump("NVIDIA H200", tmp_path / "t.json")
    gemv.cache.clear()
    assert autotune_table.load(tmp_path / "t.json", "NVIDIA H100 80GB HBM3") == 0 and not gemv.cache
    assert autotune_table.load_foreign(tmp_path / "t.json") == (1, "NVIDIA H200")
    assert gemv.cache == {key: gemv.configs[2]}
    (tmp_path / "bad.json").write_text(json.dumps({"kernels": {}}))
    for bad in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(ValueError, match="autotune table"):
            autotune_table.load_foreign(bad)


def test_shipped_tables_load(clean_caches):
    """Every table in kernels/tuned/ names kernels and configurations the code still has, and loads whole."""
    tables = sorted(autotune_table.TABLE_DIR.glob("*.json"))
    assert tables, "no shipped table (kernels/tuned/nvidia_h200.json expected)"
    for path in tables:
        table = json.loads(path.read_text())
        assert path == autotune_table.table_path(table["device"])
        total = sum(len(picks) for picks in table["kernels"].values())
        assert autotune_table.load(path, table["device"]) == total > 0
        for t in clean_caches.values():
            t.cache.clear()


def test_a_refused_table_touches_no_cache(clean_caches):
    good = autotune_table._config_json(clean_caches["fp8_gemv"].configs[0])
    bad = {"device": "X", "kernels": {"fp8_gemv": [[[1, 2], good]], "fp8_skinny": [[[3], dict(good, num_warps=3)]]}}
    with pytest.raises(ValueError, match="has no configuration"):
        autotune_table.load(bad, "X")
    assert all(not t.cache for t in clean_caches.values())
    for picks in ([[1, 2, 3]], [[[1, [2]], good]], {"k": good}):  # not a pair; a key Triton could not have; no list
        with pytest.raises(ValueError, match="pairs"):
            autotune_table.load({"device": "X", "kernels": {"fp8_gemv": picks}}, "X")
    assert all(not t.cache for t in clean_caches.values())


def test_bad_tables_are_refused(clean_caches, tmp_path):
    good = autotune_table._config_json(clean_caches["fp8_gemv"].configs[0])
    bad = {"device": "X", "triton": "3.6.0", "kernels": {"fp8_gemv": [[[1, 2], dict(good, num_warps=3)]]}}
    with pytest.raises(ValueError, match="has no configuration"):
        autotune_table.load(bad, "X")
    with pytest.raises(ValueError, match="unknown kernel"):
        autotune_table.load({"device": "X", "kernels": {"nope": []}}, "X")
    with pytest.raises(ValueError, match="expected"):
        autotune_table.load({"kernels": {}}, "X")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        autotune_table.load(tmp_path / "broken.json", "X")
    with pytest.raises(ValueError, match="cannot read"):
        autotune_table.load(tmp_path / "missing.json", "X")


@triton.autotune(configs=[triton.Config(dict(VALUE=1)), triton.Config(dict(VALUE=2))], key=["n"])
@triton.jit
def _write_value(out, n, VALUE: tl.constexpr):
    tl.store(out + tl.arange(0, 4), tl.full((4,), VALUE, tl.int32), mask=tl.arange(0, 4) < n)


def test_a_prefilled_pick_is_what_the_autotuner_runs(monkeypatch):
    """Triton's Autotuner.run with the key `load` writes (key args, then tensor dtypes) takes the pick without
    timing anything: under the interpreter timing would fail, so the launch runs only because the key matched."""
    monkeypatch.setattr(autotune_table, "AUTOTUNED", {"probe": (__name__, "_write_value")})
    out = torch.zeros(4, dtype=torch.int32)
    table = {"device": "cpu", "kernels": {"probe": [[[4, "torch.int32"],
                                                     autotune_table._config_json(_write_value.configs[1])]]}}
    _write_value.cache.clear()
    assert autotune_table.load(table, "cpu") == 1
    _write_value[(1,)](out, 4)
    assert out.tolist() == [2, 2, 2, 2]


def test_engine_config_checks_the_table_path():
    from qwen_engine.engine import QwenEngineConfig

    assert QwenEngineConfig(config="tiny", autotune_table="off").autotune_table == "off"
    with pytest.raises(ValueError, match="autotune_table"):
        QwenEngineConfig(config="tiny", autotune_table="/nonexistent/table.json")


def test_one_autotune_config_fixture(one_autotune_config):
    """conftest's fixture for the tiny CUDA engine tests leaves every autotuned kernel one configuration (its first),
    so Triton neither compiles nor times the others (monkeypatch restores them after the test)."""
    from kernels.autotune_table import autotuners

    tuners = autotuners()
    assert tuners and all(len(t.configs) == 1 for t in tuners.values())


def test_autotuners_have_their_configurations_back():
    """After the fixture's test (file order), each kernel lists all its configurations again."""
    from kernels.autotune_table import autotuners

    assert all(len(t.configs) > 1 for t in autotuners().values())


def test_override_then_restore(clean_caches):
    """`override` replaces the cached picks of every key with the given prefix by the one configuration matching the
    fields given, `restore` puts them back; an unknown kernel, a prefix no key has or fields matching other than one
    configuration raise, replacing nothing."""
    gemv = clean_caches["w4a16_gemv"]
    key1 = (1024, 2048, 1, True, True, False, 2, "torch.bfloat16")
    key2 = (1024, 2048, 2, True, True, False, 2, "torch.bfloat16")
    other = (2048, 512, 1, True, True, False, 2, "torch.bfloat16")
    gemv.cache.update({key1: gemv.configs[0], key2: gemv.configs[0], other: gemv.configs[0]})
    target = autotune_table._config_json(gemv.configs[3])
    saved = autotune_table.override([{"kernel": "w4a16_gemv", "key": [1024, 2048], "config": target}])
    assert gemv.cache[key1] is gemv.cache[key2] is gemv.configs[3] and gemv.cache[other] is gemv.configs[0]
    autotune_table.restore(saved)
    assert all(gemv.cache[k] is gemv.configs[0] for k in (key1, key2, other))
    for bad, match in (({"kernel": "nope", "key": [], "config": target}, "unknown kernel"),
                       ({"kernel": "w4a16_gemv", "key": [7], "config": target}, "no tuned key"),
                       ({"kernel": "w4a16_gemv", "key": [1024], "config": {"num_stages": 1}}, "configurations")):
        with pytest.raises(ValueError, match=match):
            autotune_table.override([{"kernel": "w4a16_gemv", "key": [1024], "config": target}, bad])
        assert all(gemv.cache[k] is gemv.configs[0] for k in (key1, key2, other))
