"""XLA's all-reduce combiner: which reductions it runs as one collective (xla.py), and its
latency in the ILP (gradient_latency.py, loss_latency.py)."""
