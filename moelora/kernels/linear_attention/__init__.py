"""Gated DeltaNet's kernels in Triton (the linear attention of Qwen3-Next and Qwen3.5,
layers/linear_attention.py): the short causal conv (conv.py), the gated delta rule
(delta_rule.py) and the gated RMSNorm (gated_norm.py), with the signatures and semantics of
their torch references in kernels/gated_delta.py. That module's docstring is the contract:
state slots, sequences whose chunk starts at position 0 starting from zeros, states written
back in place. sequences.py holds what the two recurrent kernels share: where a program's
sequence is, and what padded rows and sequences get.
"""
