"""Tree-speculation kernels (installed as ``agentspec.kernels``): torch references first.

Triton versions land with batched speculation; each will be tested against these references.
"""

from .tree import tree_depths, tree_mask, with_root

__all__ = ["tree_depths", "tree_mask", "with_root"]
