"""Tree-speculation kernels (installed as ``agentspec.kernels``).

Tree attention mask and positions, greedy verification and exact tree speculative sampling,
batched over ragged requests: torch references (``*_torch``), Triton kernels (``*_triton``,
needing the optional ``triton``), and dispatchers (Triton for CUDA tensors, torch elsewhere).
Layout and outputs: ``agentspec.kernels.tree``.
"""

from .tree import (
    check_layout,
    greedy_verify_batch,
    greedy_verify_batch_torch,
    greedy_verify_batch_triton,
    pack_trees,
    sampling_verify_batch,
    sampling_verify_batch_torch,
    sampling_verify_batch_triton,
    tree_attention,
    tree_attention_torch,
    tree_attention_triton,
    tree_depths,
    tree_mask,
    with_root,
)

__all__ = [
    "check_layout",
    "greedy_verify_batch",
    "greedy_verify_batch_torch",
    "greedy_verify_batch_triton",
    "pack_trees",
    "sampling_verify_batch",
    "sampling_verify_batch_torch",
    "sampling_verify_batch_triton",
    "tree_attention",
    "tree_attention_torch",
    "tree_attention_triton",
    "tree_depths",
    "tree_mask",
    "with_root",
]
