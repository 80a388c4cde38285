"""Interop with torch.distributed.pipelining: schedules both ways, stages and a traced Pipe under torch's runtime."""
