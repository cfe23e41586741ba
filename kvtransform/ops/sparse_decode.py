"""kvt::retrieval_topk and kvt::sparse_decode_attention (issue 6): filled in by the sparse-decode work."""
