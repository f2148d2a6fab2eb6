"""Tree-speculation kernels (installed as ``agentspec.kernels``).

Tree masks and positions (one tree) and greedy tree verification batched over ragged requests:
a torch reference (``*_torch``), a Triton kernel (``*_triton``, needing the optional ``triton``)
and a dispatcher (Triton for CUDA tensors, torch elsewhere). Layout and outputs:
``agentspec.kernels.tree``. (Sampled requests are verified by the keyed Gumbel-max rule,
``agentspec.decode.verify.seeded_target``, which needs no kernel of its own.)
"""

from .tree import *  # noqa: F401,F403  (the names tree.__all__ lists)
from .tree import __all__  # noqa: F401
