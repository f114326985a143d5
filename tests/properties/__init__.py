"""The properties every configuration keeps: bit-identical gradients (equivalence, lossless, the op
corpus) and the composition matrix with other libraries."""
