"""kvtransform's custom ops (``torch.ops.kvt.*``), one family per module.

Each op is a ``torch.library.custom_op`` with a fake (meta) implementation so torch.export and torch.compile see an
opaque node with known shapes, a registered autograd formula where training needs it, a plain-PyTorch reference
used on CPU, and a Triton kernel used on CUDA (``kvtransform.kernels``).
"""
from .attention import attention  # noqa: F401  kvt::attention, the canonical op
from . import dualkv  # noqa: F401  kvt::dualkv_attention
from . import sparse_decode  # noqa: F401  kvt::retrieval_topk, kvt::sparse_decode_attention
from . import prefix_tree  # noqa: F401  kvt::prefix_tree_attention
