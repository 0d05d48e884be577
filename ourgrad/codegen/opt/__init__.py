"""The optimizer: choosing a kernel's Opts. `search.py` is BEAM search (BEAM=n); the Opts themselves and the
hand-coded heuristic live with the Kernel."""
