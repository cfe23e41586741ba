"""kvt::dualkv_attention (issue 3): filled in by the DualKV op work."""
