"""Frontends that plug kvtransform's ops into the code users already run (``kvtransform.integrations.transformers``:
Hugging Face ``AttentionInterface`` / ``AttentionMaskInterface``)."""
from . import transformers  # noqa: F401
