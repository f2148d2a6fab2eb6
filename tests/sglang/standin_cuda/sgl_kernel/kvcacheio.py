"""``sgl_kernel.kvcacheio``: imported by the host (CPU-offload) KV pools, called only with HiCache
(--enable-hierarchical-cache)."""

from ._stub import not_provided

__all__ = [
    "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct", "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
]
for _name in __all__:
    globals()[_name] = not_provided(f"sgl_kernel.kvcacheio.{_name}", "HiCache only")
