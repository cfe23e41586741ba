"""SpeContext runtime (arXiv 2512.00722 §4–5): the static KV cache, the retrieval heads and the generation loop.

* :mod:`.cache` -- :class:`KVCache`, one ``(L, B, H_kv, max_length, D)`` K and V buffer plus ``cache_seqlens``;
* :mod:`.heads` -- :class:`RetrievalHead` and the training-free heads (``oracle``, ``recent``, ``quest``,
  ``dense``), registered by name (:func:`register_head`, :func:`make_head`);
* :mod:`.embedding_heads`, :mod:`.distilled`, :mod:`.eagle3` -- heads scoring from token embeddings: ``self``
  (training-free), ``distilled`` (trained, packaged for SmolLM2), ``eagle3`` (an EAGLE-3 draft's attention);
* :mod:`.generate` -- :class:`SpeContextRuntime`: packed prefill, the decode-step loop (eager or CUDA graph),
  sampling, per-row EOS, stats.
"""
from .cache import KVCache  # noqa: F401
from .heads import HEADS, RetrievalHead, make_head, register_head  # noqa: F401
from . import embedding_heads, distilled, eagle3  # noqa: F401,E402  (register self, distilled, eagle3)
from .generate import GenerateOutput, GenerationStats, SpeContextRuntime  # noqa: F401
