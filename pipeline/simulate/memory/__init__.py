"""Where the simulated bytes live: the live-byte tracker (`tracker`: every storage made and freed on the
simulated device, by role and phase), the replay of CUDA's caching allocator on those events (`allocator`:
the reserved bytes, default and expandable segments) and the output cache of repeated meta ops."""
