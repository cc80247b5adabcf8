"""Qwen3.6-35B-A3B text model, one file per stage (reference numerics: dense weights, fp32 or bf16).

norm.py       zero-centred RMSNorm, gated RMSNorm (GDN output)
attention.py  gated full attention: partial RoPE, q/k norm, GQA, output gate
gdn.py        Gated DeltaNet: causal conv, chunked prefill, recurrent decode step
moe.py        router (softmax, top-k renormalised), experts, sigmoid-gated shared expert
decoder.py    decoder layer (pre-norm residual mixer + MoE)
causal_lm.py  embeddings -> layers -> norm -> untied lm_head; greedy reference decoding
state.py      per-sequence state: KV cache (full attention), conv + recurrent state (GDN)
names.py      parameter-name mapping: checkpoint / transformers -> ours
"""

from .causal_lm import QwenForCausalLM, greedy_generate
from .names import PARAM_NAMES, MappedName, map_checkpoint_name, transformers_to_ours
from .state import GDNState, KVCache, QwenState

__all__ = [
    "QwenForCausalLM", "greedy_generate", "QwenState", "KVCache", "GDNState",
    "PARAM_NAMES", "MappedName", "map_checkpoint_name", "transformers_to_ours",
]
