"""Data-dependent values answered without data: stand-ins for `.item()` and friends on meta tensors
(`stand_ins`) and the host values that travel with each micro-batch (`shadows`)."""
