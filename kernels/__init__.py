"""Tree-speculation kernels (installed as ``agentspec.kernels``).

Tree attention mask and positions and greedy tree verification, batched over ragged requests:
torch references (``*_torch``), Triton kernels (``*_triton``, needing the optional ``triton``),
and dispatchers (Triton for CUDA tensors, torch elsewhere). Layout and outputs:
``agentspec.kernels.tree``. (Sampled requests are verified by the keyed Gumbel-max rule,
``agentspec.decode.verify.seeded_target``, which needs no kernel of its own.)
"""

from .tree import *  # noqa: F401,F403  (the names tree.__all__ lists)
from .tree import __all__  # noqa: F401
