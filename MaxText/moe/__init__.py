"""Dropless MoE: route -> dispatch -> grouped GEMM (gmm/) -> combine."""
