"""Helpers shared by the tests: gloo process launches, reference chains, late peers."""
