"""The several-GPU wing: N ranks in one process (`world`: torch's fake process group, FSDP2 on meta
parameters, accelerate told it runs on N GPUs), the live-byte tracker for DTensors and resized storages
(`tracker`), the loop's sharded step (`step`), the per-GPU answer (`peak.distributed_peak`) and the real
multi-process check on the CPU (`check`)."""
