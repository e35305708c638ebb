"""The VRAM loan (seed 000, DESIGN §5): guards, the decode-only resources it lends, what a
loan defers, its prompt geometry (one function: the transaction's and the forecast's), and
the transaction whose exit is the only undo path; the forecast (what a loan would cost and
whether it pays) and a request's workload, its input."""
