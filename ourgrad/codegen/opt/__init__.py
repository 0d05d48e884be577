"""The optimizer: choosing Opts for a Kernel — the hand-coded heuristic (heuristic.py) and BEAM search (search.py)."""
