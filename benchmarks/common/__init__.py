"""Helpers the benchmarks share: the machine they ran on, the peers and servers they start, the results
files they write, and the soak and synthetic-model parts. None of these is run as a command."""
