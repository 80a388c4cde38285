"""Pipeline schedules and their execution between stages; no public names yet."""

__all__: list[str] = []
