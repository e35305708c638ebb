"""Startup: plan -> ledger -> weights -> expert cache -> speculative decoding -> Runtime."""
