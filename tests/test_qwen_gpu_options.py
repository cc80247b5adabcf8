"""benchmarks/qwen_gpu.py's engine options: every `QwenEngineConfig` field a GPU run may vary reaches the engine
(`engine_phase` takes it), and an option it does not take is refused when the arguments are parsed -- not after the
full-size model is built on a rented GPU (sixty-seventh session: a `router_align_gather` variant failed so)."""

import argparse
import dataclasses
import inspect
import json

import pytest

from benchmarks import qwen_gpu
from qwen_engine.engine import QwenEngineConfig

# QwenEngineConfig fields engine_phase sets itself (from the run's shape and the script's flags) or that a speed run
# has no reason to vary; every other field must be an engine_phase option
SET_BY_ENGINE_PHASE = {
    "config", "device", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
    "max_model_len", "max_queued", "request_timeout_s", "warmup", "autotune_table", "warmup_burst",
    "gdn_prep_ba_step",  # from the gdn_prep_tiling option
    "checkpoint", "weights", "seed", "sampling_seed", "kernel_self_check", "kernels", "kv_cache_memory_fraction",
    "decode_buckets", "expert_layout", "lone_prefill_min_tokens",
}


def test_every_engine_option_reaches_the_engine():
    options = set(inspect.signature(qwen_gpu.engine_phase).parameters)
    fields = {f.name for f in dataclasses.fields(QwenEngineConfig)}
    missing = sorted(fields - options - SET_BY_ENGINE_PHASE)
    assert not missing, f"QwenEngineConfig fields a --variant cannot set (add them to engine_phase): {missing}"
    assert SET_BY_ENGINE_PHASE <= fields, sorted(SET_BY_ENGINE_PHASE - fields)  # no stale names here


def test_variant_and_base_accept_engine_options():
    name, options = qwen_gpu._variant('gather={"router_align_gather": true, "gdn_state_dtype": "bfloat16"}')
    assert name == "gather" and options == {"router_align_gather": True, "gdn_state_dtype": "bfloat16"}
    builds = '{"block_m": 8, "gate_up": {"ahead": 4, "mma_v2": true}, "down": {"ahead": 4}}'
    assert qwen_gpu._json_options(f'{{"regs_builds": {builds}}}')["regs_builds"]["gate_up"]["mma_v2"] is True
    # builds given as a JSON string are kept parsed: the engine sets them from a dict
    assert qwen_gpu._json_options(f'{{"regs_builds": {json.dumps(builds)}}}')["regs_builds"]["block_m"] == 8
    # a variant may name its own prefill buckets; --base may not (the first engine's come from --prefill-buckets)
    assert qwen_gpu._variant('b={"prefill_buckets": [512]}')[1] == {"prefill_buckets": [512]}
    with pytest.raises(argparse.ArgumentTypeError):
        qwen_gpu._base_options('{"prefill_buckets": [512]}')


@pytest.mark.parametrize("text", [
    'x={"router_align_gathr": true}',  # a misspelt option
    'x={"ctx": 2048}',  # engine_phase's own argument, not an option
    'x={"regs_builds": {"block_m": 32, "gate_up": {}, "down": {}}}',  # a block the kernel has not
    'x={"regs_builds": {"block_m": 8, "gate_up": {"ahead": 4, "warps": 8}, "down": {}}}',  # an unknown build key
    'x=[1, 2]',  # not an object
    '1x={}',  # not an identifier
])
def test_variant_refuses_what_the_engine_would_not_take(text):
    with pytest.raises(argparse.ArgumentTypeError):
        qwen_gpu._variant(text)
