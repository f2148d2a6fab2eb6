"""Small random models and packed KV caches for the kernel tests."""

from __future__ import annotations

import torch

__all__ = ["packed_cache", "random_model"]


def random_model(packed_linears: bool = False):
    """A small random bfloat16 model; ``packed_linears``: with the native row-invariant linears
    (``Transformer.pack_linears``) on its decode rows, as the engine runs a bf16 model on CPU."""
    from agentspec.backends.embedded.model import ModelArgs, Transformer

    args = ModelArgs(dim=576, n_layers=3, n_heads=9, n_kv_heads=3, hidden_dim=256, vocab_size=300,
                     max_seq_len=1024)
    torch.manual_seed(0)
    model = Transformer(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
        for layer in model.layers:  # norms near 1, as trained models have
            layer.attn_norm.weight.normal_(1, 0.1)
            layer.ffn_norm.weight.normal_(1, 0.1)
    model = model.to(torch.bfloat16)
    if packed_linears:
        assert model.pack_linears()
    return args, model


def packed_cache(args, cap):
    from agentspec.backends.embedded.model import KVCache

    return KVCache(args, cap, dtype=torch.float32, device=torch.device("cpu"), packed=True)
