"""A rank's stages: materialised from the meta device, tied again, compiled, run, their batch norms and parameters."""
