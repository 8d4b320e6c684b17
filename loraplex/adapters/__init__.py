"""The adapter as a file: PEFT format in, validated canonical weights out, stored by content hash.

    from loraplex.adapters import AdapterLimits, BaseModelSpec, LocalAdapterStore, load_adapter

    spec = BaseModelSpec.from_model_dir("path/to/base-model")       # or .from_config(hf_config)
    adapter = load_adapter("upload.zip", spec, AdapterLimits(max_rank=64))
    adapter.content_hash                      # sha256: names this immutable version everywhere
    adapter.weights[(0, "q_proj")].a          # [r, in]  fp32
    adapter.weights[(0, "q_proj")].b          # [out, r] fp32, alpha/r (or alpha/sqrt(r)) folded in
    store = LocalAdapterStore("data/adapters")      # or open_store("s3://bucket/adapters", cache_dir=...)
    store.put(adapter); store.get(adapter.content_hash)

`load_adapter(path, spec, limits=None) -> CanonicalAdapter` accepts a folder (adapter_config.json +
adapter_model.safetensors, at the top or in one sub-folder), either of those two files, a .zip / .tar /
.tar.gz / .tgz (unpacked with `safe_extract` under `limits`), or a canonical store entry file. Pickle files
(.bin .pt .pth .pkl .ckpt) are refused, never opened. Every refusal is an `AdapterValidationError` whose
message names the problem and whose `code` is an `ErrorCode`.

Canonical weights are keyed by (layer, module) with module one of `MODULES` (q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj); fused PEFT modules (qkv_proj, gate_up_proj) arrive split into those.
The delta a module adds is `x @ a.T @ b.T`. LoRA on the LM head and on the input embedding is keyed
(TOP_LEVEL, "lm_head") and (TOP_LEVEL, "embed_tokens") (`TOP_MODULES`): the head's a is [r, hidden] and b
[vocab, r]; the embedding's a is [r, vocab] (PEFT's lora_embedding_A) and b [hidden, r], the delta of token t
being `a[:, t] @ b.T`. Also: `adapter.layer(i)` (module -> weights), `.rank` (largest),
`.target_modules`, `.layers`, `.nbytes`, `.check_compatible(spec)` (for entries read back from a store).

`AdapterStore` is the storage protocol: put(adapter) -> location, get(hash, verify=False), exists(hash),
delete(hash) -> bool, list() -> hashes. `LocalAdapterStore(root)` keeps `<root>/<hash>.safetensors` (atomic
temp + rename); `S3AdapterStore(bucket, prefix=..., cache_dir=...)` keeps the same objects in a bucket.
"""

from .archive import safe_extract
from .canonical import CanonicalAdapter, LoraWeights, content_hash
from .errors import AdapterValidationError, ErrorCode
from .limits import AdapterLimits
from .loader import load_adapter
from .spec import ARCHITECTURES, MODULES, TOP_LEVEL, TOP_MODULES, BaseModelSpec, ModuleShape, ModuleSlice
from .store import AdapterStore, LocalAdapterStore, read_entry
from .store_s3 import S3AdapterStore, open_store

__all__ = [
    "ARCHITECTURES",
    "MODULES",
    "TOP_LEVEL",
    "TOP_MODULES",
    "AdapterLimits",
    "AdapterStore",
    "AdapterValidationError",
    "BaseModelSpec",
    "CanonicalAdapter",
    "ErrorCode",
    "LocalAdapterStore",
    "LoraWeights",
    "ModuleShape",
    "ModuleSlice",
    "S3AdapterStore",
    "content_hash",
    "load_adapter",
    "open_store",
    "read_entry",
    "safe_extract",
]
