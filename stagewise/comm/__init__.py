"""Process groups, device mesh and point-to-point transfer between stages; no public names yet."""

__all__: list[str] = []
