"""Losses: micro-batches and their weights, token means, non-finite losses, the loss every rank learns."""
